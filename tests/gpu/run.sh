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
. "$here/lib.sh"

gpu_need_root_and_fuse
gpu_need_nvidia
gpu_need_devremapd

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gpu_checkpoint "$tmp"
echo "--- devremapd cuda-device-map"
"$DEVREMAPD" cuda-device-map --metadata "$tmp/saved.json" --spec "$tmp/config.json" --host-dev "$HOST_DEV" || true

export DEVREMAPD HOST_DEV tmp first alias here
unshare -m --propagation private sh -eu <<'INNER'
. "$here/lib.sh"
trap 'gpu_stop_devremapd "$tmp"' EXIT
gpu_mount_dev "$tmp"
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
gpu_check_alias
python3 -c "import os, sys; fd = os.open('/dev/nvidia$alias', os.O_RDWR); print('opened /dev/nvidia$alias: fd', fd); os.close(fd)"
INNER
echo "PASS"
