#!/bin/sh
# Installs devremap on the node from this image (node-setup.yaml's init container):
#   - devremapd and devremap-runtime into $DEVREMAP_HOST/usr/local/bin, each by a rename, so a
#     running daemon's SIGUSR2 upgrade finds the new binary whole;
#   - runtime.json as $DEVREMAP_HOST/etc/devremap/runtime.json, only when there is none: an
#     operator's config is never overwritten;
#   - every containerd/*.toml into $DEVREMAP_HOST/etc/containerd/conf.d/, and then restarts
#     containerd in the host's namespaces (unless DEVREMAP_RESTART_CONTAINERD=0).
# containerd reads conf.d only when its config.toml imports it: without that, this refuses
# and says what to add.
set -eu
host="${DEVREMAP_HOST:-/host}"
src="${DEVREMAP_SOURCE:-/opt/devremap}"

containerd_config="$host/etc/containerd/config.toml"
if ! grep -qs '^imports *=.*/etc/containerd/conf\.d/' "$containerd_config"; then
    echo "node-setup: $containerd_config does not import /etc/containerd/conf.d/*.toml;" \
        "add the line imports = [\"/etc/containerd/conf.d/*.toml\"] at its top and run again" >&2
    exit 1
fi

for bin in devremapd devremap-runtime; do
    install -D -m 0755 "$src/bin/$bin" "$host/usr/local/bin/.$bin.new"
    mv -f "$host/usr/local/bin/.$bin.new" "$host/usr/local/bin/$bin"
done

if [ ! -e "$host/etc/devremap/runtime.json" ]; then
    install -D -m 0644 "$src/runtime.json" "$host/etc/devremap/runtime.json"
fi

# The entries name the package's /usr/bin/devremap-runtime; this installs into /usr/local/bin.
for entry in "$src"/containerd/*.toml; do
    [ -e "$entry" ] || continue
    to="$host/etc/containerd/conf.d/$(basename "$entry")"
    mkdir -p "$(dirname "$to")"
    sed 's|/usr/bin/devremap-runtime|/usr/local/bin/devremap-runtime|g' "$entry" > "$to.new"
    chmod 0644 "$to.new"
    mv -f "$to.new" "$to"
done

if [ "${DEVREMAP_RESTART_CONTAINERD:-1}" = 1 ]; then
    nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd
fi
echo "node-setup: devremap installed"
