#!/bin/sh
# devremap on a real NVIDIA GPU host: mounts devremap over /dev in a private mount namespace
# (unshare -m) with the host's GPUs, then through it runs `nvidia-smi -L` and a CUDA program
# (PyTorch if installed, else the CUDA driver API through python3's ctypes), and opens a
# checkpoint-name alias: the host's GPUs, recorded with `devremapd record`, are restored under
# names shifted by 100 (saved nvidia100 is paired with host nvidia0, and so on).
#
#   sudo sh tests/gpu/run.sh            # after cargo build --release
#
# Skips (exit 0, a line starting with SKIP:) where there is no GPU, no nvidia-smi, no root or
# no /dev/fuse. DEVREMAPD overrides the binary; HOST_DEV the device directory whose nvidiaN
# are the GPUs (default /dev). Nothing outside the private namespace is changed.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
DEVREMAPD=${DEVREMAPD:-$here/../../target/release/devremapd}
HOST_DEV=${HOST_DEV:-/dev}

skip() { echo "SKIP: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root (mounts FUSE)"
[ -e /dev/fuse ] || skip "/dev/fuse is missing"
command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found: not an NVIDIA GPU host"
ls "$HOST_DEV"/nvidia[0-9]* >/dev/null 2>&1 || skip "no $HOST_DEV/nvidiaN: no NVIDIA GPU here"
[ -x "$DEVREMAPD" ] || { echo "FAIL: $DEVREMAPD not found (cargo build --release)"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/config.json" <<'JSON'
{"ociVersion": "1.0.2", "root": {"path": "rootfs"},
 "mounts": [{"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]}
JSON

echo "--- devremapd record: the host's GPUs"
"$DEVREMAPD" record --spec "$tmp/config.json" --host-dev "$HOST_DEV" --output "$tmp/host.json"
cat "$tmp/host.json"
# The checkpoint: the same GPUs, saved under minor + 100.
awk '/"minor":/ { sub(/[0-9]+/, $2 + 100) } { print }' "$tmp/host.json" > "$tmp/saved.json"
first=$(awk -F'[:,]' '/"minor":/ { gsub(/ /, "", $2); print $2; exit }' "$tmp/host.json")
alias=$((first + 100))

echo "--- devremapd plan"
"$DEVREMAPD" plan --metadata "$tmp/saved.json" --spec "$tmp/config.json" --host-dev "$HOST_DEV"
echo "--- devremapd cuda-device-map"
"$DEVREMAPD" cuda-device-map --metadata "$tmp/saved.json" --spec "$tmp/config.json" --host-dev "$HOST_DEV" || true

mkdir "$tmp/mnt"
export DEVREMAPD HOST_DEV tmp first alias
unshare -m --propagation private sh -eu <<'INNER'
"$DEVREMAPD" mount "$tmp/mnt" --metadata "$tmp/saved.json" --spec "$tmp/config.json" \
    --host-dev "$HOST_DEV" --pid-file "$tmp/pid" 2> "$tmp/daemon.log" &
i=0
until [ -s "$tmp/pid" ]; do
    i=$((i + 1)); [ "$i" -lt 1000 ] || { cat "$tmp/daemon.log"; exit 1; }
    sleep 0.01
done
stop() { kill "$(cat "$tmp/pid")" 2>/dev/null || true; }
trap stop EXIT
mount --bind "$tmp/mnt" /dev
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
echo "--- /dev in the namespace"
grep ' /dev ' /proc/self/mounts
ls -l /dev/nvidia*
echo "--- nvidia-smi -L through devremap"
nvidia-smi -L
echo "--- a CUDA program through devremap"
if python3 -c 'import torch' 2>/dev/null; then
    python3 -c 'import torch; x = torch.ones(1024, device="cuda"); print("torch:", torch.cuda.get_device_name(0), float((x * 2).sum()))'
else
    python3 - <<'PY'
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} failed: CUDA error {rc}")
ok(cuda.cuInit(0), "cuInit")
n = ctypes.c_int()
ok(cuda.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
dev = ctypes.c_int()
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
name = ctypes.create_string_buffer(256)
ok(cuda.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
ctx = ctypes.c_void_p()
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
ptr = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20), "cuMemAlloc")
ok(cuda.cuMemsetD8_v2(ptr, 7, 1 << 20), "cuMemsetD8")
out = (ctypes.c_ubyte * 16)()
ok(cuda.cuMemcpyDtoH_v2(out, ptr, 16), "cuMemcpyDtoH")
print(f"cuda: {n.value} devices, device 0 {name.value.decode()}, memset/copy gave {list(out)[:4]}")
PY
fi
echo "--- the checkpoint name /dev/nvidia$alias opens host GPU nvidia$first"
stat -c '%n %t:%T %A' "/dev/nvidia$alias" "/dev/nvidia$first"
[ "$(stat -c %t:%T "/dev/nvidia$alias")" = "$(stat -c %t:%T "/dev/nvidia$first")" ]
python3 -c "import os, sys; fd = os.open('/dev/nvidia$alias', os.O_RDWR); print('opened /dev/nvidia$alias: fd', fd); os.close(fd)"
INNER
echo "PASS"
