//! The NVIDIA Container Toolkit's legacy hook as a spec asks for it: whether the spec carries
//! the hook, which GPUs its `NVIDIA_VISIBLE_DEVICES` selects ([`request`]), and which of the
//! driver's control nodes its `NVIDIA_DRIVER_CAPABILITIES` gives ([`capabilities`]).
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
    let env = Env::of(spec);
    let effective = match env.last("NVIDIA_VISIBLE_DEVICES") {
        None if env.legacy_image() => Some("all"),
        value => value,
    };
    effective.map_or(Ok(None), visible::parse)
}

/// The driver capabilities that decide which control nodes the hook gives: libnvidia-container
/// mounts `nvidia-uvm` and `nvidia-uvm-tools` only with `compute`, `nvidia-modeset` only with
/// `display` (`nvc_mount.c`: "Only compute libraries require specific devices (e.g. UVM)",
/// "Only display capability requires the modeset device"); `nvidiactl` and the GPUs always.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub compute: bool,
    pub display: bool,
}

impl Capabilities {
    /// Every capability (`all`, or a legacy CUDA image without the variable).
    pub const ALL: Capabilities = Capabilities { compute: true, display: true };
}

/// A spec built by hand (no environment read) is taken to ask for every capability.
impl Default for Capabilities {
    fn default() -> Capabilities {
        Capabilities::ALL
    }
}

/// `NVIDIA_DRIVER_CAPABILITIES` read as the toolkit's hook reads it
/// (`getDriverCapabilities`): set and not empty, the capabilities it lists (`all`: every one);
/// unset in a legacy CUDA image, every one; otherwise (unset, or empty) the default,
/// `compute,utility`. A name the toolkit does not know fails the hook, and so the container,
/// whatever is served; here it is only not one that gives a node.
pub fn capabilities(spec: &Spec) -> Capabilities {
    let env = Env::of(spec);
    match env.last("NVIDIA_DRIVER_CAPABILITIES") {
        None if env.legacy_image() => Capabilities::ALL,
        Some(listed) if !listed.is_empty() => {
            let has = |name: &str| listed.split(',').map(str::trim).any(|c| c == name || c == "all");
            Capabilities { compute: has("compute"), display: has("display") }
        }
        _ => Capabilities { compute: true, display: false },
    }
}

/// The spec's `process.env`, read as the toolkit reads it: a map, the last value of a name
/// winning.
struct Env(Vec<String>);

impl Env {
    fn of(spec: &Spec) -> Env {
        Env(spec.process().as_ref().and_then(|p| p.env().clone()).unwrap_or_default())
    }

    fn last(&self, name: &str) -> Option<&str> {
        self.0.iter().rev().find_map(|e| e.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')))
    }

    /// A legacy CUDA image (the toolkit's `IsLegacy`): `CUDA_VERSION` set, `NVIDIA_REQUIRE_CUDA`
    /// unset or empty.
    fn legacy_image(&self) -> bool {
        let set = |name: &str| self.last(name).is_some_and(|v| !v.is_empty());
        set("CUDA_VERSION") && !set("NVIDIA_REQUIRE_CUDA")
    }
}
