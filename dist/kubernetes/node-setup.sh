#!/bin/sh
# Installs devremap on the node from this image (node-setup.yaml's init container):
#   - devremapd and devremap-runtime into the host's /usr/local/bin, each by a rename, so a
#     running daemon's SIGUSR2 upgrade finds the new binary whole;
#   - runtime.json as the host's /etc/devremap/runtime.json, by a rename, only when there is
#     none (or an empty one): an operator's config is never overwritten;
#   - the CRI runtime handler `devremap` (containerd/devremap.toml) into the host's
#     /etc/containerd/config.toml itself, keeping everything else (`devremapd containerd-config`,
#     docs/install.md); then restarts containerd in the host's namespaces, only when that file
#     changed (and unless DEVREMAP_RESTART_CONTAINERD=0).
# Not a conf.d drop-in: containerd (1.6 and 1.7) replaces a plugin's whole table with an
# imported file's, so a drop-in would drop the node's CRI settings. For the same reason, when a
# file that config.toml imports holds CRI settings, this refuses and says what to add by hand.
# A refusal installs nothing and exits 1.
#
# Paths, as the host sees them (the tests point them elsewhere): DEVREMAP_HOST (/host) is where
# the host's root is mounted ("" for this root), DEVREMAP_BIN_DIR (/usr/local/bin),
# DEVREMAP_RUNTIME_CONFIG (/etc/devremap/runtime.json), DEVREMAP_CONTAINERD_CONFIG
# (/etc/containerd/config.toml); DEVREMAP_SOURCE (/opt/devremap) is this image's files.
set -eu
host="${DEVREMAP_HOST-/host}"
src="${DEVREMAP_SOURCE:-/opt/devremap}"
bin_dir="${DEVREMAP_BIN_DIR:-/usr/local/bin}"
wrapper_config="${DEVREMAP_RUNTIME_CONFIG:-/etc/devremap/runtime.json}"
containerd_config="${DEVREMAP_CONTAINERD_CONFIG:-/etc/containerd/config.toml}"
config="$host$containerd_config"
entry="$src/containerd/devremap.toml"

fail() {
    echo "node-setup: $*" >&2
    exit 1
}

# containerd's config, edited by the image's devremapd (`devremapd containerd-config`, which
# reads every form of TOML and keeps every other byte of the file); it prints `changed` or
# `unchanged`, and refuses (exit 1, saying why on stderr) what it cannot add to.
edit_containerd_config() {
    "$src/bin/devremapd" containerd-config --host-root "${host:-/}" --config "$containerd_config" \
        --entry "$entry" --runtime "$bin_dir/devremap-runtime" "$@"
}

# Checks first: a refusal installs nothing.
[ -f "$src/bin/devremapd" ] && [ -f "$src/bin/devremap-runtime" ] && [ -f "$entry" ] ||
    fail "$src does not hold bin/devremapd, bin/devremap-runtime and containerd/devremap.toml"
edit_containerd_config --dry-run >/dev/null || fail "nothing installed; $config left as it was"

for bin in devremapd devremap-runtime; do
    install -D -m 0755 "$src/bin/$bin" "$host$bin_dir/.$bin.new"
    mv -f "$host$bin_dir/.$bin.new" "$host$bin_dir/$bin"
done

# By a rename: a setup killed while writing leaves no empty config that later runs would keep
# (an empty one, which the wrapper cannot read, is replaced too).
if [ ! -s "$host$wrapper_config" ]; then
    mkdir -p "$(dirname "$host$wrapper_config")"
    tmp="$(mktemp "$host$wrapper_config.XXXXXX")"
    cat "$src/runtime.json" >"$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$host$wrapper_config" ||
        { rm -f "$tmp"; fail "cannot install $host$wrapper_config"; }
fi

changed="$(edit_containerd_config)" || fail "$config left as it was"
if [ "$changed" = changed ]; then
    echo "node-setup: added the runtime handler devremap to $containerd_config"
    if [ "${DEVREMAP_RESTART_CONTAINERD:-1}" = 1 ]; then
        nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd
        echo "node-setup: restarted containerd"
    fi
else
    echo "node-setup: $containerd_config already has the runtime handler devremap; containerd not restarted"
fi
echo "node-setup: devremap installed"
