#!/usr/bin/env bash
# See devremap work: a container whose /dev/nvidia0 follows its GPU when the GPU moves.
#
# Run as root on a Linux machine with runc and a static busybox (Debian: apt-get install runc
# busybox-static) and /dev/fuse:
#
#     sudo examples/demo.sh
#
# It builds a fake two-GPU host from ordinary char devices (nvidia0 is /dev/null's device 1:3,
# nvidia1 is /dev/zero's 1:5), serves a devremap /dev for a checkpoint that saved GPU 0, starts
# a runc container on it that asks for the host's GPUs as `docker run --gpus all` does (the
# NVIDIA hook, here a no-op script, and NVIDIA_VISIBLE_DEVICES=all), and shows the container's
# /dev/nvidia0 reaching host GPU 0. Then host GPU 0 goes away, as when another job takes it, so
# saved GPU 0 is re-paired with host GPU 1; a SIGHUP reloads the daemon and the running
# container's /dev/nvidia0 reaches host GPU 1.
# On a terminal it waits for Enter before moving the GPU. Everything lives in one temporary
# directory, and the container, the daemon, the mount and the directory are removed at the end,
# also on Ctrl-C or SIGTERM.
#
# DEVREMAPD=/path/to/devremapd uses that binary; otherwise it is built with cargo.

set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '%s\n' "$*"; }
die() { printf 'demo.sh: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run me as root (the daemon mounts FUSE with device nodes, runc needs root)"
[ -c /dev/fuse ] || die "/dev/fuse is missing (modprobe fuse)"
command -v runc >/dev/null || die "runc is not installed (apt-get install runc)"
busybox=$(command -v busybox) || die "busybox is not installed (apt-get install busybox-static)"
if ldd "$busybox" >/dev/null 2>&1; then
    die "$busybox is not static, so it cannot run in an empty rootfs (apt-get install busybox-static)"
fi

if [ -n "${DEVREMAPD:-}" ]; then
    devremapd=$DEVREMAPD
else
    say "building devremapd (cargo build --release)..."
    cargo build --release --quiet --manifest-path "$repo/Cargo.toml"
    devremapd=$repo/target/release/devremapd
fi

# One directory holds everything; mktemp makes it 0700 and root's, so no other user reaches
# the mount inside it.
work=$(mktemp -d "${TMPDIR:-/tmp}/devremap-demo.XXXXXX")
mnt=$work/dev
bundle=$work/bundle
id=devremap-demo-$$
daemon_pid=
runc_pid=
cleaned=

runc_() { runc --root "$work/runc" "$@"; }

cleanup() {
    [ -z "$cleaned" ] || return 0
    cleaned=1
    set +e
    if [ -n "$runc_pid" ]; then
        # The container may not exist yet when runc is still creating it: try for a while.
        for _ in $(seq 50); do
            runc_ delete -f "$id" >/dev/null 2>&1
            kill -0 "$runc_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$runc_pid" 2>/dev/null
        wait "$runc_pid" 2>/dev/null
        runc_ delete -f "$id" >/dev/null 2>&1
    fi
    if [ -n "$daemon_pid" ]; then
        kill -TERM "$daemon_pid" 2>/dev/null
        wait "$daemon_pid" 2>/dev/null
    fi
    if mountpoint -q "$mnt" 2>/dev/null; then
        umount -l "$mnt"
    fi
    if grep -qF " $work" /proc/self/mountinfo; then
        say "demo.sh: something is still mounted under $work; left it there" >&2
        return
    fi
    rm -rf "$work"
    say "cleaned up: container deleted, daemon stopped, mount and $work removed"
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap 'cleanup; exit 129' HUP
trap 'cleanup; exit 141' PIPE

# Polls for up to 20 s until "$@" succeeds.
wait_for() {
    local what=$1
    shift
    for _ in $(seq 200); do
        if "$@"; then return 0; fi
        sleep 0.1
    done
    {
        say "demo.sh: timed out waiting for $what; the daemon's log, then the container's output:"
        cat "$work/devremapd.log" "$work/container.out" 2>/dev/null
    } >&2
    exit 1
}

# Whether the container has printed at least $1 lines.
container_said() { [ "$(grep -c '^container:' "$work/container.out")" -ge "$1" ]; }

say "working in $work"

# 1. A fake host: two "GPUs" that are harmless char devices, and no driver files.
mkdir -p "$work/host/dev" "$work/host/root"
mknod -m 0666 "$work/host/dev/nvidia0" c 1 3
mknod -m 0666 "$work/host/dev/nvidia1" c 1 5
say "fake host: nvidia0 is char 1:3 (reads nothing, like /dev/null), nvidia1 is char 1:5 (reads zeros)"

# 2. The checkpoint's device list: it saved GPU 0.
printf '[{"minor": 0}]\n' >"$work/checkpoint.json"

# 3. A bundle: a busybox rootfs and the spec `runc spec` writes, with no terminal and a
#    script that shows /dev/nvidia0, waits for it to change, and shows it again. The spec asks
#    for every GPU as `docker run --gpus all` does with the NVIDIA Container Toolkit: its
#    prestart hook and NVIDIA_VISIBLE_DEVICES=all. devremap gives a container only the GPUs runc
#    and that hook would give it (a spec that asks for none gets none); this host has no
#    toolkit, so the hook is a script that does nothing.
mkdir -p "$bundle/rootfs/bin" "$bundle/rootfs/proc" "$bundle/rootfs/sys" "$bundle/rootfs/dev"
cp "$busybox" "$bundle/rootfs/bin/busybox"
for applet in sh stat head wc sleep; do ln -s busybox "$bundle/rootfs/bin/$applet"; done
cat >"$bundle/rootfs/show-gpu.sh" <<'EOF'
show() { echo "container: /dev/nvidia0 is char $(stat -c %t:%T /dev/nvidia0) and gives" $(head -c 4 /dev/nvidia0 | wc -c) "of 4 bytes read"; }
show
first=$(stat -c %t:%T /dev/nvidia0)
while [ "$(stat -c %t:%T /dev/nvidia0)" = "$first" ]; do sleep 0.1; done
show
EOF
hook=$work/nvidia-container-runtime-hook
printf '#!/bin/sh\ncat >/dev/null\n' >"$hook"
chmod 0755 "$hook"
(cd "$bundle" && runc spec)
hook_in_sed=$(printf '%s' "$hook" | sed 's/[&|\\]/\\&/g')
sed -i -e 's/"terminal": true/"terminal": false/' -e 's|^\(\s*\)"sh"$|\1"sh", "/show-gpu.sh"|' \
    -e 's|^\(\s*\)"TERM=xterm"$|\1"TERM=xterm", "NVIDIA_VISIBLE_DEVICES=all"|' \
    -e 's|^\(\s*\)"ociVersion": .*,$|&\n\1"hooks": {"prestart": [{"path": "'"$hook_in_sed"'", "args": ["nvidia-container-runtime-hook", "prestart"]}]},|' \
    "$bundle/config.json"
grep -q '"NVIDIA_VISIBLE_DEVICES=all"' "$bundle/config.json" && grep -q '"prestart"' "$bundle/config.json" ||
    die "runc spec wrote a config.json this script cannot edit: $bundle/config.json"

# 4. The devremap /dev, then the spec pointed at it.
mkdir "$mnt"
"$devremapd" mount "$mnt" --metadata "$work/checkpoint.json" --spec "$bundle/config.json" \
    --host-dev "$work/host/dev" --host-root "$work/host/root" \
    --state-file "$work/state.json" 2>"$work/devremapd.log" &
daemon_pid=$!
wait_for "the daemon to serve $mnt" test -e "$work/state.json"
say "devremapd serves $mnt (pid $daemon_pid): saved GPU 0 is paired with host GPU 0"
"$devremapd" oci-patch "$bundle/config.json" --dev "$mnt" --in-place

# 5. The container.
runc_ run --bundle "$bundle" "$id" </dev/null >"$work/container.out" 2>&1 &
runc_pid=$!
wait_for "the container's first line" container_said 1
grep '^container:' "$work/container.out"

# 6. Host GPU 0 goes away; saved GPU 0 is re-paired with host GPU 1; reload. On a terminal,
#    wait for Enter first (from a pipe, for its end; from /dev/null, not at all).
if [ -t 0 ]; then say "press Enter to take host GPU 0 away and reload"; fi
read -r _ || true
rm "$work/host/dev/nvidia0"
say "host GPU 0 is gone: saved GPU 0 is re-paired with host GPU 1; reloading with SIGHUP"
kill -HUP "$daemon_pid"
wait_for "the reload" grep -q '"generation":2' "$work/state.json"
wait_for "the container's second line" container_said 2
grep '^container:' "$work/container.out" | tail -n 1
wait "$runc_pid" || die "the container failed: $(cat "$work/container.out")"
runc_pid=
say "the running container's /dev/nvidia0 followed its GPU; the daemon said:"
grep 'reloaded' "$work/devremapd.log" | sed 's/^/  /'
