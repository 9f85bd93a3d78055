# Sourced (POSIX sh) by tests/gpu/run.sh and tests/gpu/restore.sh: the checks that make them
# skip, the checkpoint they restore (the host's GPUs recorded with `devremapd record`, saved
# under minors shifted by 100: saved nvidia100 is paired with host nvidia0), and a devremap
# /dev mounted over /dev inside a private mount namespace.
#
# Assumes the caller set DEVREMAPD (the binary) and HOST_DEV (the device directory whose
# nvidiaN are the GPUs). Every wait is bounded (wait_until); nothing outside the caller's
# scratch directory and its private mount namespace is changed.

skip() { echo "SKIP: $*"; exit 0; }
fail() { echo "FAIL: $*"; exit 1; }

# Root and /dev/fuse: what mounting devremap needs.
gpu_need_root_and_fuse() {
    [ "$(id -u)" = 0 ] || skip "needs root (mounts FUSE)"
    [ -e /dev/fuse ] || skip "/dev/fuse is missing"
}

# An NVIDIA GPU: nvidia-smi, and nvidiaN in HOST_DEV.
gpu_need_nvidia() {
    command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found: not an NVIDIA GPU host"
    ls "$HOST_DEV"/nvidia[0-9]* >/dev/null 2>&1 || skip "no $HOST_DEV/nvidiaN: no NVIDIA GPU here"
}

gpu_need_devremapd() {
    [ -x "$DEVREMAPD" ] || fail "$DEVREMAPD not found (cargo build --release, or set DEVREMAPD)"
}

# wait_until SECONDS WHAT COMMAND...: runs COMMAND every 0.1 s until it succeeds; after
# SECONDS, says what it waited for and returns 1.
wait_until() {
    _wu_limit=$1 _wu_what=$2
    shift 2
    _wu_end=$(($(date +%s) + _wu_limit))
    until "$@"; do
        if [ "$(date +%s)" -ge "$_wu_end" ]; then
            echo "FAIL: timed out after ${_wu_limit}s waiting for $_wu_what"
            return 1
        fi
        sleep 0.1
    done
}

# gpu_checkpoint DIR: the checkpoint of this host's GPUs in DIR: config.json (a spec with the
# runtime's /dev/pts and /dev/shm, asking the NVIDIA hook for every GPU), host.json
# (`devremapd record`), saved.json (the same GPUs under minor + 100). Sets `first` (the first
# host GPU's minor) and `alias` (its checkpoint minor, first + 100).
#
# A spec is given only the GPUs it lists or the hook selects (issue 29.3), so this one asks as
# `docker run --gpus all` writes it: a prestart hook named nvidia-container-runtime-hook and
# NVIDIA_VISIBLE_DEVICES=all. That selects HOST_DEV's nvidiaN whatever their numbers (a real
# GPU's 195:N, --fake's 1:5) and gives the driver's control nodes (nvidiactl, nvidia-uvm, ...)
# that CUDA opens. No runtime runs here, so the hook is never run: DIR/nvidia-container-
# runtime-hook, a script that does nothing, stands in for the toolkit's on either host.
gpu_checkpoint() {
    printf '#!/bin/sh\ncat > /dev/null\n' > "$1/nvidia-container-runtime-hook"
    chmod 755 "$1/nvidia-container-runtime-hook"
    cat > "$1/config.json" <<JSON
{"ociVersion": "1.0.2", "root": {"path": "rootfs"},
 "process": {"user": {"uid": 0, "gid": 0}, "args": ["sh"], "cwd": "/",
             "env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all"]},
 "hooks": {"prestart": [{"path": "$1/nvidia-container-runtime-hook",
                         "args": ["nvidia-container-runtime-hook", "prestart"]}]},
 "mounts": [{"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]}
JSON
    echo "--- devremapd record: the host's GPUs"
    "$DEVREMAPD" record --spec "$1/config.json" --host-dev "$HOST_DEV" --output "$1/host.json"
    cat "$1/host.json"
    awk '/"minor":/ { sub(/[0-9]+/, $2 + 100) } { print }' "$1/host.json" > "$1/saved.json"
    first=$(awk -F'[:,]' '/"minor":/ { gsub(/ /, "", $2); print $2; exit }' "$1/host.json")
    [ -n "$first" ] || fail "devremapd record wrote no GPU into $1/host.json"
    alias=$((first + 100))
    echo "--- devremapd plan: saved nvidia$alias is host nvidia$first"
    "$DEVREMAPD" plan --metadata "$1/saved.json" --spec "$1/config.json" --host-dev "$HOST_DEV"
}

# gpu_mount_dev DIR [FLAG...]: in the caller's (private) mount namespace, serves DIR/saved.json
# with `devremapd mount DIR/mnt` (its keeper's pid in DIR/pid, its log DIR/daemon.log, FLAGs
# added), waits until it answers, and mounts it over /dev with the runtime's /dev/pts and
# /dev/shm. Pair it with gpu_stop_devremapd DIR.
gpu_mount_dev() {
    _md_dir=$1
    shift
    mkdir -p "$_md_dir/mnt"
    "$DEVREMAPD" mount "$_md_dir/mnt" --metadata "$_md_dir/saved.json" --spec "$_md_dir/config.json" \
        --host-dev "$HOST_DEV" --pid-file "$_md_dir/pid" "$@" 2> "$_md_dir/daemon.log" &
    if ! wait_until 30 "devremapd to answer (its pid file $_md_dir/pid)" test -s "$_md_dir/pid"; then
        cat "$_md_dir/daemon.log"
        return 1
    fi
    mount --bind "$_md_dir/mnt" /dev
    mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
    mount -t tmpfs -o mode=1777 shm /dev/shm
}

# gone PID: the process has exited (no such pid, or a zombie its parent has not reaped yet:
# kill -0 still reaches a zombie).
gone() {
    [ -e "/proc/$1" ] || return 0
    [ "$(sed 's/.*) //; s/ .*//' "/proc/$1/stat" 2>/dev/null)" = Z ]
}

# gpu_stop_devremapd DIR: SIGTERM to the daemon gpu_mount_dev started, waiting (bounded) until
# its keeper is gone, which unmounts; reaps it when it is this shell's child.
gpu_stop_devremapd() {
    [ -s "$1/pid" ] || return 0
    _sd_pid=$(cat "$1/pid")
    kill "$_sd_pid" 2>/dev/null || return 0
    wait_until 30 "devremapd (pid $_sd_pid) to stop" gone "$_sd_pid" || return 1
    wait "$_sd_pid" 2>/dev/null || true
}

# gpu_check_alias: the checkpoint name /dev/nvidia$alias is the device of host GPU nvidia$first.
gpu_check_alias() {
    echo "--- the checkpoint name /dev/nvidia$alias opens host GPU nvidia$first"
    stat -c '%n %t:%T %A' "/dev/nvidia$alias" "/dev/nvidia$first"
    [ "$(stat -c %t:%T "/dev/nvidia$alias")" = "$(stat -c %t:%T "/dev/nvidia$first")" ] ||
        fail "/dev/nvidia$alias is not the device of /dev/nvidia$first"
}
