//! The NVIDIA Container Toolkit's legacy hook as a spec asks for it: whether the spec carries
//! the hook, and which GPUs its `NVIDIA_VISIBLE_DEVICES` selects ([`request`]).
//!
//! Pure: from a parsed spec to a value. Assumption: the hook is recognised by its path's suffix
//! (`/nvidia-container-runtime-hook`), as every toolkit install names it.

use super::visible::{self, Visible, VisibleError};
use oci_spec::runtime::Spec;

/// What the spec asks of the toolkit's legacy hook (a `prestart` hook ending in
/// `/nvidia-container-runtime-hook`, or a `createRuntime` one on Podman 5; it makes the GPUs'
/// nodes itself):
/// `NVIDIA_VISIBLE_DEVICES` read as the toolkit reads it (`internal/config/image`,
/// `DevicesFromEnvvars`): the variable's last value (the toolkit makes a map of the
/// environment); unset, empty, only commas or `void`: nothing; unset in a legacy CUDA image
/// (`CUDA_VERSION` set, `NVIDIA_REQUIRE_CUDA` unset or empty): every GPU.
///
/// The toolkit's CDI mode asks nothing this way: its hooks (`createContainer` hooks ending in
/// `/nvidia-cdi-hook`: `create-symlinks`, `update-ldcache`, ...) make no device node, the CDI
/// spec lists the GPUs it gives in `linux.devices`, and it appends `NVIDIA_VISIBLE_DEVICES=void`
/// after whatever the image's `ENV` said, so that no legacy hook reads it. Reading the value
/// before that `void` served every GPU to an image with `ENV NVIDIA_VISIBLE_DEVICES=all`.
pub fn request(spec: &Spec) -> Result<Option<Visible>, VisibleError> {
    let Some(hooks) = spec.hooks() else { return Ok(None) };
    // Podman 5 hands its hooks directory's `prestart` hooks (the toolkit's `oci-nvidia-hook.json`)
    // to the runtime as `createRuntime`, the stage the runtime spec put in prestart's place.
    #[allow(deprecated)]
    let legacy = [hooks.prestart(), hooks.create_runtime()]
        .into_iter()
        .flatten()
        .flatten()
        .any(|h| h.path().to_string_lossy().ends_with("/nvidia-container-runtime-hook"));
    if !legacy {
        return Ok(None);
    }
    let env = spec.process().as_ref().and_then(|p| p.env().clone()).unwrap_or_default();
    let last = |name: &str| env.iter().rev().find_map(|e| e.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')));
    let set = |name: &str| last(name).is_some_and(|v| !v.is_empty());
    let effective = match last("NVIDIA_VISIBLE_DEVICES") {
        None if set("CUDA_VERSION") && !set("NVIDIA_REQUIRE_CUDA") => Some("all"),
        value => value,
    };
    effective.map_or(Ok(None), visible::parse)
}
