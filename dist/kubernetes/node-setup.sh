#!/bin/sh
# Installs devremap on the node from this image (node-setup.yaml's init container), in one of
# two modes, DEVREMAP_MODE:
#   - nri (the default, issue 32): the node daemon is containerd's NRI plugin `devremap`
#     (`devremapd node --nri`), which gives every GPU container a devremap /dev with no runtime
#     class: containerd's config is not touched, and NRI must be enabled in it already
#     (containerd 1.7: `[plugins."io.containerd.nri.v1.nri"]` with `disable = false`; 2.x has it
#     on by default): checked by its socket, /var/run/nri/nri.sock on the host, and refused,
#     saying how to enable it, when there is none;
#   - runtimeclass: containerd runs devremap-runtime for pods of `runtimeClassName: devremap`
#     (runtimeclass.yaml), for clusters whose containerd has no NRI: the runtime handler below.
# Either way:
#   - devremapd and devremap-runtime into the host's /usr/local/bin, each by a rename, so a
#     running daemon's SIGUSR2 upgrade finds the new binary whole;
#   - runtime.json as the host's /etc/devremap/runtime.json, by a rename, only when there is
#     none (or an empty one): an operator's config is never overwritten;
#   - (runtimeclass) the CRI runtime handler `devremap` (containerd/devremap.toml) into the host's
#     /etc/containerd/config.toml itself, keeping everything else (`devremapd containerd-config`,
#     docs/install.md); then restarts containerd in the host's namespaces, only when that file
#     changed (and unless DEVREMAP_RESTART_CONTAINERD=0);
#   - the node daemon as the host's systemd service: systemd/devremap.service, its ExecStart
#     naming the installed devremapd (with --nri in the nri mode), as the host's /etc/systemd/system/devremap.service,
#     enabled and started; when devremapd or the unit changed and the node runs, the node is
#     restarted (the keepers serve on: KillMode=process) and SIGUSR2 has every container's
#     server run the new devremapd. Not a process of this pod: each container's keeper is the
#     node's child, and a pod's processes die with the pod (its update, its eviction), which
#     would take every container's /dev. A host without systemd gets no service: there
#     devremap-runtime starts a node daemon itself when none answers. DEVREMAP_NODE_SERVICE=0
#     installs the unit but asks nothing of systemd.
# Not a conf.d drop-in: containerd (1.6 and 1.7) replaces a plugin's whole table with an
# imported file's, so a drop-in would drop the node's CRI settings. For the same reason, when a
# file that config.toml imports holds CRI settings, this refuses and says what to add by hand.
# A refusal installs nothing and exits 1.
#
# Paths, as the host sees them (the tests point them elsewhere): DEVREMAP_HOST (/host) is where
# the host's root is mounted ("" for this root), DEVREMAP_BIN_DIR (/usr/local/bin),
# DEVREMAP_RUNTIME_CONFIG (/etc/devremap/runtime.json), DEVREMAP_CONTAINERD_CONFIG
# (/etc/containerd/config.toml), DEVREMAP_SYSTEMD_UNIT (/etc/systemd/system/devremap.service);
# DEVREMAP_SOURCE (/opt/devremap) is this image's files.
set -eu
host="${DEVREMAP_HOST-/host}"
src="${DEVREMAP_SOURCE:-/opt/devremap}"
bin_dir="${DEVREMAP_BIN_DIR:-/usr/local/bin}"
wrapper_config="${DEVREMAP_RUNTIME_CONFIG:-/etc/devremap/runtime.json}"
containerd_config="${DEVREMAP_CONTAINERD_CONFIG:-/etc/containerd/config.toml}"
config="$host$containerd_config"
entry="$src/containerd/devremap.toml"
unit_src="$src/systemd/devremap.service"
unit="${DEVREMAP_SYSTEMD_UNIT:-/etc/systemd/system/devremap.service}"
mode="${DEVREMAP_MODE:-nri}"
nri_socket=/var/run/nri/nri.sock

fail() {
    echo "node-setup: $*" >&2
    exit 1
}

# A command in the host's namespaces (this pod has hostPID).
on_host() {
    nsenter --target 1 --mount --uts --ipc --net --pid -- "$@"
}

# containerd's config, edited by the image's devremapd (`devremapd containerd-config`, which
# reads every form of TOML and keeps every other byte of the file); it prints `changed` or
# `unchanged`, and refuses (exit 1, saying why on stderr) what it cannot add to.
edit_containerd_config() {
    "$src/bin/devremapd" containerd-config --host-root "${host:-/}" --config "$containerd_config" \
        --entry "$entry" --runtime "$bin_dir/devremap-runtime" "$@"
}

# Checks first: a refusal installs nothing.
[ -f "$src/bin/devremapd" ] && [ -f "$src/bin/devremap-runtime" ] && [ -f "$entry" ] && [ -f "$unit_src" ] ||
    fail "$src does not hold bin/devremapd, bin/devremap-runtime, containerd/devremap.toml and systemd/devremap.service"
case "$mode" in
nri)
    on_host test -S "$nri_socket" ||
        fail "nothing installed: containerd on this node has NRI off (no $nri_socket). Enable it in $containerd_config:
    [plugins.\"io.containerd.nri.v1.nri\"]
      disable = false
  (containerd 1.7; 2.x has NRI on unless disabled), restart containerd, and this setup runs again on its next start;
  or set DEVREMAP_MODE=runtimeclass in node-setup.yaml and apply runtimeclass.yaml (docs/restore.md, Kubernetes)" ;;
runtimeclass) edit_containerd_config --dry-run >/dev/null || fail "nothing installed; $config left as it was" ;;
*) fail "DEVREMAP_MODE=$mode: expected nri or runtimeclass" ;;
esac

# Whether the node daemon's binary changes: then the running node and every server move to it.
node_changed=0
cmp -s "$src/bin/devremapd" "$host$bin_dir/devremapd" || node_changed=1
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

if [ "$mode" = nri ]; then
    echo "node-setup: NRI mode: $containerd_config left as it was (NRI is on: $nri_socket)"
elif ! changed="$(edit_containerd_config)"; then
    fail "$config left as it was"
elif [ "$changed" = changed ]; then
    echo "node-setup: added the runtime handler devremap to $containerd_config"
    if [ "${DEVREMAP_RESTART_CONTAINERD:-1}" = 1 ]; then
        on_host systemctl restart containerd
        echo "node-setup: restarted containerd"
    fi
else
    echo "node-setup: $containerd_config already has the runtime handler devremap; containerd not restarted"
fi
# The unit, naming the installed devremapd, by a rename and only when it changed.
unit_changed=0
mkdir -p "$(dirname "$host$unit")"
tmp="$(mktemp "$host$unit.XXXXXX")"
nri_flag=
[ "$mode" = runtimeclass ] || nri_flag=" --nri"
sed -e "s#/usr/bin/devremapd#$bin_dir/devremapd#g" -e "s#devremapd node#devremapd node$nri_flag#" "$unit_src" >"$tmp" &&
    chmod 0644 "$tmp" ||
    { rm -f "$tmp"; fail "cannot write $host$unit"; }
if cmp -s "$tmp" "$host$unit"; then
    rm -f "$tmp"
else
    mv -f "$tmp" "$host$unit"
    unit_changed=1
fi
if [ "${DEVREMAP_NODE_SERVICE:-1}" != 1 ]; then
    echo "node-setup: installed $unit; devremap.service not started (DEVREMAP_NODE_SERVICE=${DEVREMAP_NODE_SERVICE})"
elif on_host test -d /run/systemd/system; then
    [ "$unit_changed" = 0 ] || on_host systemctl daemon-reload || fail "systemctl daemon-reload failed on the node"
    on_host systemctl --quiet enable devremap.service || fail "cannot enable devremap.service on the node"
    if ! on_host systemctl --quiet is-active devremap.service; then
        on_host systemctl start devremap.service || fail "devremap.service did not start (journalctl -u devremap.service on the node)"
        echo "node-setup: started devremap.service"
    elif [ "$node_changed" = 1 ] || [ "$unit_changed" = 1 ]; then
        # The new node adopts the keepers before its READY=1, which the restart waits for.
        on_host systemctl restart devremap.service ||
            fail "devremap.service did not restart (journalctl -u devremap.service on the node); the containers' /dev serve on"
        # To the node alone, which passes it on to every keeper (--kill-who: every systemd
        # knows it; 252 added the name --kill-whom).
        [ "$node_changed" = 0 ] || on_host systemctl kill --kill-who=main --signal=SIGUSR2 devremap.service ||
            fail "cannot send SIGUSR2 to devremap.service: the containers' servers still run the old devremapd"
        echo "node-setup: restarted devremap.service"
    fi
else
    echo "node-setup: the host runs no systemd; devremap-runtime starts the node daemon itself"
fi
echo "node-setup: devremap installed"
