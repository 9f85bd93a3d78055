#!/bin/sh
# The mission on a real NVIDIA GPU, in one command (issue 33): a CUDA process whose GPU is
# opened through a checkpoint name on a devremap /dev is checkpointed and restored, and its
# data is the same after.
#
# 1. devremapd serves a devremap /dev over /dev in a private mount namespace (unshare -m), with
#    the host's GPUs recorded and the checkpoint saying nvidia100: saved minor 100 is paired
#    with host nvidia0 (tests/gpu/lib.sh, as tests/gpu/run.sh does).
# 2. A PyTorch process there makes tensors from a fixed seed, keeps them, and holds
#    /dev/nvidia100 open; CUDA opens the native nodes itself. Its char-device descriptors are
#    printed from /proc/PID/fd with the mount each was opened through.
# 3. From a second process, the CUDA driver API (cuda-bindings, else ctypes): lock,
#    checkpoint, then a devremap reload (the --prefer-file changed, SIGHUP, the state file's
#    generation rises), restore (with `devremapd cuda-device-map`'s pairs) and unlock, the state
#    printed at each step. The process then checks its tensors against the seed: PASS.
# 4. CRIU, if `criu check` passes: the same process, closed its /dev/nvidia100 (CRIU cannot
#    dump a GPU descriptor) and locked and checkpointed by the CUDA API as cuda-checkpoint
#    does, is dumped by CRIU (which kills it), the daemon reloads, CRIU restores it through the
#    devremap /dev (its stdin is that /dev's null), the CUDA API restores and unlocks it, and its
#    tensors are compared again. Otherwise SKIP for that part, with the reason.
#
#   sudo sh tests/gpu/restore.sh          # after cargo build --release
#   sudo sh tests/gpu/restore.sh --fake   # no GPU: the same steps without CUDA
#
# --fake runs steps 1, 2 and 4 and the reload with a fake GPU (a char node 1:5, /dev/zero's,
# named nvidia0 in a scratch device directory) and a plain python3 process holding
# /dev/nvidia100 open instead of CUDA; tests/gpu_script.rs runs it in CI.
#
# Skips (exit 0, a line starting with SKIP:) where there is no root, no /dev/fuse, and (GPU
# mode) no nvidia-smi, no GPU or no PyTorch that sees one. Exit 1 with a FAIL: line when a step
# fails. Every wait is bounded, and the whole run is stopped after DEVREMAP_GPU_LIMIT seconds
# (default 330); processes and mounts are cleaned up on every exit. Environment: DEVREMAPD (the
# binary), CRIU (a criu to try first; then .criu/criu from tests/gpu/carry-criu.sh, a criu on
# PATH, ../shared/tools/criu/criu), DEVREMAP_GPU_LOGS (a directory that gets the daemon's, the
# app's and CRIU's logs), DEVREMAP_GPU_MIB (the data's size, default 320 on a GPU, 16 fake).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
DEVREMAPD=${DEVREMAPD:-$repo/target/release/devremapd}
. "$here/lib.sh"

MODE=gpu
[ "${1:-}" = --fake ] && MODE=fake
LIMIT=${DEVREMAP_GPU_LIMIT:-330}

rpy() { python3 "$here/restore.py" "$@"; }

# The app's pid, once it has answered `ready`.
app_pid() { sed 's/^{"pid": \([0-9]*\).*/\1/' "$tmp/before.json"; }

# reload WORD: writes WORD into the --prefer-file, sends SIGHUP and waits until the state
# file's generation rises, with no error.
reload() {
    g0=$("$repo/examples/state" "$tmp/state.json" generation)
    echo "$1" > "$tmp/prefer"
    kill -HUP "$(cat "$tmp/pid")"
    wait_until 30 "the reload after SIGHUP (generation above $g0)" \
        sh -c '[ "$("$0" "$1" generation)" -gt "$2" ]' "$repo/examples/state" "$tmp/state.json" "$g0"
    echo "devremap reload (prefer $1): $("$repo/examples/state" "$tmp/state.json" generation last_error reloads)"
    [ "$("$repo/examples/state" "$tmp/state.json" last_error)" = null ] || fail "the reload reported an error"
}

# cuda ACTION [ARG...]: one checkpoint call on the app from a second process, bounded.
cuda() {
    _action=$1
    shift
    timeout 120 python3 "$here/restore.py" cuda "$_action" "$(app_pid)" "$@" || fail "cuda $_action (exit $?)"
}

# cuda_restore: the CUDA restore, with devremapd's pairs where it gave them, and the unlock.
# A restore that refuses the pairs is tried once more without them, so that one run on a
# GPU says both what the driver said of the pairs and whether the rest holds; the run then
# ends in FAIL all the same (map_refused).
cuda_restore() {
    if [ -z "$map" ]; then
        cuda restore
    elif ! timeout 120 python3 "$here/restore.py" cuda restore "$(app_pid)" --map "$map"; then
        echo "the CUDA restore refused cuda-device-map's pairs (above): once more without them"
        map_refused=1
        cuda restore
    fi
    cuda unlock
}

# fds: the app's char-device descriptors, each with the mount it was opened through.
fds() {
    echo "--- the app's char devices ($1)"
    rpy fds "$(app_pid)" | tee "$tmp/fds"
}

# check_data NAME WHAT: asks the app for its data's sums, which must be the seed's, as before.
check_data() {
    rpy ask "$tmp/app" sum --timeout 120 --save "$tmp/$1.json" > /dev/null || fail "the app did not answer after $2"
    rpy same "$tmp/before.json" "$tmp/$1.json" || fail "the data changed across $2"
}

# native_rdev: the rdev of host GPU nvidia$first as this /dev serves it.
native_rdev() { python3 -c 'import os, sys; r = os.stat(sys.argv[1]).st_rdev; print(f"{os.major(r)}:{os.minor(r)}")' "/dev/nvidia$first"; }

# alias_fd_rdev NAME: the rdev of the app's /dev/nvidia100 descriptor in the answer NAME.
alias_fd_rdev() { python3 -c 'import json, sys; a = json.load(open(sys.argv[1]))["alias_fd"]; print(a["rdev"] if a else "closed")' "$tmp/$1.json"; }

# pick_criu: the first CRIU whose `criu check` passes (CRIU, .criu/criu, criu on PATH, the
# shared build), in $criu; else returns 1 with the last failure in $criu_why.
pick_criu() {
    criu_why="no CRIU found (CRIU, $repo/.criu/criu from tests/gpu/carry-criu.sh, criu on PATH, ../shared/tools/criu/criu)"
    for criu in "${CRIU:-}" "$repo/.criu/criu" "$(command -v criu || true)" "$repo/../shared/tools/criu/criu"; do
        [ -n "$criu" ] && [ -x "$criu" ] || continue
        if timeout 60 "$criu" check > "$tmp/criu-check.log" 2>&1; then
            echo "$criu check: $(tail -n 1 "$tmp/criu-check.log")"
            return 0
        fi
        criu_why="$criu check failed: $(grep -v '^Warn' "$tmp/criu-check.log" | tail -n 2 | tr '\n' ' ')"
    done
    return 1
}

# The CUDA driver API's checkpoint and restore around a reload (step 3); with --fake, the
# reload alone under the held descriptor.
cuda_part() {
    if [ "$MODE" = gpu ]; then
        echo "--- the CUDA driver API: lock, checkpoint, a devremap reload, restore, unlock"
        cuda state
        cuda lock --timeout-ms 30000
        cuda checkpoint
        fds "checkpointed: CUDA has released its own"
    else
        echo "--- a devremap reload while the app holds /dev/nvidia$alias"
    fi
    reload checkpoint
    gpu_check_alias
    if [ "$MODE" = gpu ]; then
        cuda_restore
    fi
    fds "after the $([ "$MODE" = gpu ] && echo restore || echo reload)"
    if [ "$MODE" = gpu ]; then
        grep -q " /dev/nvidia$first .* through /dev (fuse devremap)" "$tmp/fds" ||
            fail "the restored process has no /dev/nvidia$first opened through the devremap /dev"
    fi
    check_data after-cuda "the reload"
    [ "$(alias_fd_rdev after-cuda)" = "$(native_rdev)" ] ||
        fail "the app's /dev/nvidia$alias descriptor is $(alias_fd_rdev after-cuda), not host nvidia$first's $(native_rdev)"
    if [ "$MODE" = gpu ]; then
        echo "PASS: CUDA checkpoint and restore around a devremap reload: /dev/nvidia$alias held, the tensors equal"
    else
        echo "PASS: (fake GPU) a devremap reload under a held /dev/nvidia$alias: the descriptor and the data equal"
    fi
}

# CRIU dumps the app and restores it through the devremap /dev (step 4).
criu_part() {
    echo "--- CRIU"
    if ! pick_criu; then
        echo "SKIP: CRIU: $criu_why"
        return 0
    fi
    pid=$(app_pid)
    if [ "$MODE" = gpu ]; then
        # CRIU dumps a char device only for major 1 (mem): the GPU descriptor the app holds
        # goes, CUDA's own go with the checkpoint.
        rpy ask "$tmp/app" close --timeout 30 > /dev/null || fail "the app did not close /dev/nvidia$alias"
        cuda lock --timeout-ms 30000
        cuda checkpoint
    fi
    fds "before the dump"
    mkdir -p "$tmp/img" "$tmp/criu-plugins"
    # -L: an empty plugin directory, so that no CRIU plugin (cuda_plugin.so) does what the
    # calls above do.
    timeout 240 "$criu" dump -t "$pid" -D "$tmp/img" -L "$tmp/criu-plugins" -o dump.log -v4 ||
        { tail -n 20 "$tmp/img/dump.log"; fail "criu dump (exit $?)"; }
    wait_until 30 "the dumped app (pid $pid) to end" gone "$pid"
    wait "$pid" 2>/dev/null || true
    echo "criu dump: done, pid $pid ended; image $(du -sh "$tmp/img" | cut -f1)"
    reload native
    timeout 240 "$criu" restore -D "$tmp/img" -L "$tmp/criu-plugins" -d -o restore.log -v4 ||
        { tail -n 20 "$tmp/img/restore.log"; fail "criu restore (exit $?)"; }
    kill -0 "$pid" 2>/dev/null || fail "the restored app (pid $pid) is not running"
    echo "criu restore: pid $pid runs again"
    if [ "$MODE" = gpu ]; then
        cuda_restore
        rpy ask "$tmp/app" reopen --timeout 30 > /dev/null || fail "the app did not reopen /dev/nvidia$alias"
    fi
    fds "restored by CRIU"
    check_data after-criu "CRIU's dump and restore"
    [ "$(alias_fd_rdev after-criu)" = "$(native_rdev)" ] ||
        fail "the restored /dev/nvidia$alias descriptor is $(alias_fd_rdev after-criu), not host nvidia$first's $(native_rdev)"
    grep -q "^  fd   0 /dev/null .* through /dev (fuse devremap)" "$tmp/fds" ||
        fail "the restored app's stdin is not /dev/null of the devremap /dev"
    if [ "$MODE" = gpu ]; then
        echo "PASS: CRIU dump and restore of the CUDA process through the devremap /dev: the tensors equal"
    else
        echo "PASS: (fake GPU) CRIU dump and restore through the devremap /dev: /dev/nvidia$alias reopened, the data equal"
    fi
}

# Stage 2, in the private mount namespace.
in_namespace() {
    trap inner_cleanup EXIT
    trap 'exit 1' INT TERM HUP
    gpu_mount_dev "$tmp" --prefer-file "$tmp/prefer" --state-file "$tmp/state.json"
    echo "--- /dev in the namespace"
    grep ' /dev ' /proc/self/mounts
    ls -l /dev/nvidia*
    gpu_check_alias
    echo "--- the app: $MODE data, /dev/nvidia$alias held"
    setsid python3 "$here/restore.py" app --mode "$MODE" --dir "$tmp/app" --alias "/dev/nvidia$alias" \
        --mib "$MIB" < /dev/null > "$tmp/app.log" 2>&1 &
    echo "$!" >> "$tmp/pids"
    if ! rpy ask "$tmp/app" ready --timeout 180 --save "$tmp/before.json" > /dev/null; then
        cat "$tmp/app.log"
        fail "the app did not start"
    fi
    echo "app pid $(app_pid) on $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["device"])' "$tmp/before.json")"
    fds "running"
    [ "$(alias_fd_rdev before)" = "$(native_rdev)" ] || fail "the app's /dev/nvidia$alias is not host nvidia$first"
    map_refused=
    cuda_part
    criu_part
    rpy ask "$tmp/app" exit --timeout 30 > /dev/null || true
    [ -z "$map_refused" ] || fail "the CUDA restore refused cuda-device-map's pairs ($map); the rest passed without them"
}

inner_cleanup() {
    rc=$?
    trap - EXIT
    for p in $(cat "$tmp/pids" 2>/dev/null); do
        if grep -qs restore.py "/proc/$p/cmdline"; then
            kill -KILL "$p" 2>/dev/null || true
            wait_until 30 "the app (pid $p) to end" gone "$p" || true
        fi
        if gone "$p"; then wait "$p" 2>/dev/null || true; fi
    done
    gpu_stop_devremapd "$tmp" || rc=1
    exit "$rc"
}

outer_cleanup() {
    rc=$?
    trap - EXIT
    # What a namespace stage killed at the time limit may have left.
    for p in $(cat "$tmp/pids" 2>/dev/null); do
        grep -qs restore.py "/proc/$p/cmdline" && kill -KILL "$p" 2>/dev/null || true
    done
    if [ -s "$tmp/pid" ] && ! gone "$(cat "$tmp/pid")"; then
        kill "$(cat "$tmp/pid")" 2>/dev/null || true
        wait_until 15 "devremapd to stop" gone "$(cat "$tmp/pid")" || kill -KILL "$(cat "$tmp/pid")" 2>/dev/null || true
    fi
    if [ -n "${DEVREMAP_GPU_LOGS:-}" ]; then
        # Each log's last 5000 lines (CRIU's, at -v4, can be long), named apart.
        mkdir -p "$DEVREMAP_GPU_LOGS"
        for f in daemon.log app.log criu-check.log img/dump.log img/restore.log; do
            [ -f "$tmp/$f" ] && tail -n 5000 "$tmp/$f" > "$DEVREMAP_GPU_LOGS/$(echo "$f" | sed 's|^img/|criu-|')" || true
        done
    fi
    rm -rf "$tmp"
    exit "$rc"
}

if [ "${DEVREMAP_GPU_STAGE:-}" = namespace ]; then
    in_namespace
    exit 0
fi

gpu_need_root_and_fuse
command -v python3 > /dev/null 2>&1 || skip "python3 not found"
if [ "$MODE" = gpu ]; then
    HOST_DEV=${HOST_DEV:-/dev}
    gpu_need_nvidia
    # One import of torch (seconds, on a fresh machine): 2 without it, 1 when it sees no GPU.
    torch_rc=0
    python3 -c 'import sys
try:
    import torch
except ImportError:
    sys.exit(2)
sys.exit(not torch.cuda.is_available())' 2> /dev/null || torch_rc=$?
    [ "$torch_rc" != 2 ] || skip "no PyTorch: python3 cannot import torch"
    [ "$torch_rc" = 0 ] || skip "PyTorch sees no CUDA GPU"
    MIB=${DEVREMAP_GPU_MIB:-320}
else
    MIB=${DEVREMAP_GPU_MIB:-16}
fi
gpu_need_devremapd

tmp=$(mktemp -d /tmp/devremap-gpu.XXXXXX)
trap outer_cleanup EXIT
trap 'exit 1' INT TERM HUP
if [ "$MODE" = fake ]; then
    HOST_DEV=$tmp/host-dev
    mkdir "$HOST_DEV"
    mknod -m 666 "$HOST_DEV/nvidia0" c 1 5
else
    # The UVM nodes CUDA opens, made on the host before it is recorded: in the namespace /dev is
    # read-only.
    if command -v nvidia-modprobe > /dev/null 2>&1; then nvidia-modprobe -u -c=0 || true; fi
    echo "--- the host"
    nvidia-smi -L
    ls -l "$HOST_DEV"/nvidia* || true
fi
gpu_checkpoint "$tmp"
echo "--- devremapd cuda-device-map: the pairs the CUDA restore gets"
map=$("$DEVREMAPD" cuda-device-map --metadata "$tmp/saved.json" --spec "$tmp/config.json" --host-dev "$HOST_DEV" \
    2> "$tmp/map.err") || map=
echo "${map:-none: $(cat "$tmp/map.err")}"
echo native > "$tmp/prefer"
: > "$tmp/pids"

export DEVREMAPD HOST_DEV MODE MIB tmp first alias map
rc=0
DEVREMAP_GPU_STAGE=namespace timeout -k 20 "$LIMIT" unshare -m --propagation private sh "$0" "$@" || rc=$?
[ "$rc" = 124 ] && echo "FAIL: the run passed its limit of $LIMIT s (DEVREMAP_GPU_LIMIT)"
[ "$rc" = 0 ] || exit 1
echo "PASS"
