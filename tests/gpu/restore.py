#!/usr/bin/env python3
"""The processes of tests/gpu/restore.sh (python3, standard library; torch and cuda-bindings
where there is a GPU):

  restore.py app --mode gpu|fake --dir DIR --alias PATH [--mib N]
      The process that is checkpointed. It opens PATH (the checkpoint name, /dev/nvidia100) and
      keeps the descriptor, makes its data from a fixed seed (gpu: PyTorch tensors on the GPU;
      fake: bytes in memory) and then answers commands (ask) through files in DIR, so that it
      holds no pipe or terminal CRIU would have to restore. Its stdio are whatever the script
      gives it (/dev/null of the devremap /dev, a log file).
  restore.py ask DIR WORD [--timeout S] [--save PATH]
      Sends WORD (sum, close, reopen, exit) to the app and prints its answer (JSON), saved to
      PATH too; exit 1 when no answer comes within S seconds.
  restore.py same BEFORE AFTER
      Exit 0 when two answers of `sum` hold the same data, each as the seed made it.
  restore.py fds PID
      Prints the char-device descriptors of PID: number, path, rdev (from /proc/PID/fd), and the
      mount they were opened through (fdinfo's mnt_id in PID's mountinfo: its mount point, type
      and source; devremap's is `fuse devremap`).
  restore.py cuda ACTION PID [--timeout-ms N] [--map OLD=NEW,...]
      ACTION is state, lock, checkpoint, restore or unlock: the CUDA driver API's
      cuCheckpointProcess* call on PID, through cuda-bindings (`cuda.bindings.driver`, or the
      older `cuda.cuda`), else ctypes on libcuda.so.1; prints the process's checkpoint state
      after it. --map (restore): `devremapd cuda-device-map`'s pairs.

The app's commands are files: DIR/cmd holds "N WORD", the answer is DIR/reply.N, each written
whole and renamed into place, so neither side reads half of one.
"""
import argparse
import ctypes
import hashlib
import json
import os
import random
import stat
import sys
import time

SEED = 20260
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


def rdev(st):
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def write_whole(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


# ---- the app ------------------------------------------------------------------------------


def sizes(mib):
    """The data's parts, in bytes: 1 MiB, a sixteenth of the rest, the rest."""
    rest = max(mib - 1, 2) << 20
    return [1 << 20, rest // 16, rest - rest // 16]


class FakeData:
    """Bytes in memory, each part random from its seed."""

    def __init__(self, parts):
        self.parts = [random.Random(SEED + i).randbytes(n) for i, n in enumerate(parts)]
        self.expected = [hashlib.sha256(p).hexdigest() for p in self.parts]

    def sums(self):
        return [{"sha256": hashlib.sha256(p).hexdigest()} for p in self.parts]


class GpuData:
    """Float32 tensors on the GPU, each made on the CPU from its seed and copied over; `sums`
    copies them back (their bytes' sha256) and adds them up on the GPU (a kernel that runs)."""

    def __init__(self, parts):
        import torch

        self.torch = torch
        self.parts, self.expected = [], []
        for i, n in enumerate(parts):
            cpu = torch.randn(n // 4, generator=torch.Generator().manual_seed(SEED + i))
            self.expected.append(hashlib.sha256(cpu.numpy().tobytes()).hexdigest())
            self.parts.append(cpu.to("cuda"))
        torch.cuda.synchronize()
        self.device = torch.cuda.get_device_name(0)

    def sums(self):
        out = []
        for t in self.parts:
            out.append(
                {
                    "sha256": hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest(),
                    "gpu_sum": float(t.double().sum().item()),
                }
            )
        self.torch.cuda.synchronize()
        return out


def app(args):
    # Only what the script gives it: a descriptor inherited from whoever started the script
    # (a harness's stray /dev/null outside the namespace) is nothing CRIU could restore.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.makedirs(args.dir, exist_ok=True)
    fd = os.open(args.alias, os.O_RDWR)
    data = (GpuData if args.mode == "gpu" else FakeData)(sizes(args.mib))

    def answer(word):
        reply = {"pid": os.getpid(), "word": word}
        if word in ("sum", "ready"):
            reply["sums"] = data.sums()
            reply["expected"] = data.expected
            reply["device"] = getattr(data, "device", "fake")
        reply["alias_fd"] = None if fd is None else {"fd": fd, "rdev": rdev(os.fstat(fd))}
        reply["alias_name"] = rdev(os.stat(args.alias))
        return reply

    write_whole(os.path.join(args.dir, "reply.0"), json.dumps(answer("ready")))
    done = 0
    while True:
        try:
            with open(os.path.join(args.dir, "cmd")) as f:
                n, word = f.read().split()
            n = int(n)
        except (OSError, ValueError):
            n = done
        if n <= done:
            time.sleep(0.05)
            continue
        done = n
        try:
            if word == "close" and fd is not None:
                os.close(fd)
                fd = None
            elif word == "reopen" and fd is None:
                fd = os.open(args.alias, os.O_RDWR)
            reply = answer(word)
        except Exception as e:  # an answer, not a dead app: the script reports it
            reply = {"pid": os.getpid(), "word": word, "error": f"{type(e).__name__}: {e}"}
        write_whole(os.path.join(args.dir, f"reply.{n}"), json.dumps(reply))
        if word == "exit":
            return 0


def ask(args):
    try:
        with open(os.path.join(args.dir, "cmd")) as f:
            n = int(f.read().split()[0]) + 1
    except OSError:
        n = 1
    if args.word != "ready":
        write_whole(os.path.join(args.dir, "cmd"), f"{n} {args.word}")
    else:
        n = 0
    path = os.path.join(args.dir, f"reply.{n}")
    end = time.monotonic() + args.timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            print(f"FAIL: the app did not answer {args.word!r} within {args.timeout:g} s")
            return 1
        time.sleep(0.05)
    with open(path) as f:
        reply = json.load(f)
    if args.save:
        write_whole(args.save, json.dumps(reply))
    print(json.dumps(reply))
    if "error" in reply:
        print(f"FAIL: the app answered {args.word!r} with {reply['error']}")
        return 1
    return 0


def same(args):
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    ok = True
    for i, (b, a, want) in enumerate(zip(before["sums"], after["sums"], after["expected"])):
        if b["sha256"] != want or a["sha256"] != want:
            print(f"part {i}: sha256 {b['sha256'][:16]} before, {a['sha256'][:16]} after, {want[:16]} from the seed")
            ok = False
        if "gpu_sum" in b and abs(a["gpu_sum"] - b["gpu_sum"]) > 1e-9 * max(1.0, abs(b["gpu_sum"])):
            print(f"part {i}: the GPU's sum {b['gpu_sum']!r} before, {a['gpu_sum']!r} after")
            ok = False
    n = len(after["sums"])
    if ok and n == len(before["sums"]) == len(after["expected"]):
        print(f"data equal: {n} parts, each as its seed made it, before and after")
        return 0
    return 1


# ---- /proc --------------------------------------------------------------------------------


def fds(args):
    pid = args.pid
    mounts = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            dash = fields.index("-")
            mounts[fields[0]] = (fields[4], f"{fields[dash + 1]} {fields[dash + 2]}")
    for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            path = os.readlink(f"/proc/{pid}/fd/{name}")
            st = os.stat(f"/proc/{pid}/fd/{name}")
            with open(f"/proc/{pid}/fdinfo/{name}") as f:
                mnt = next((l.split()[1] for l in f if l.startswith("mnt_id:")), "?")
        except OSError:
            continue  # closed meanwhile
        if stat.S_ISCHR(st.st_mode):
            where, fs = mounts.get(mnt, ("?", "?"))
            print(f"  fd {name:>3} {path:<24} {rdev(st):<8} through {where} ({fs})")
    return 0


# ---- the CUDA driver API's checkpoint calls -------------------------------------------------


class CudaError(Exception):
    pass


def uuid_bytes(text):
    raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise CudaError(f"--map: {text!r} is not a GPU UUID")
    return raw


class Bindings:
    """cuda-bindings: each call returns (CUresult, values...)."""

    def __init__(self, driver):
        self.d = driver
        self.name = f"cuda-bindings ({driver.__name__})"
        self.call("cuInit", 0)

    def call(self, fn, *args):
        res = getattr(self.d, fn)(*args)
        err = res[0]
        if int(err) != 0:
            name = self.d.cuGetErrorName(err)[1]
            raise CudaError(f"{fn}: {name.decode() if isinstance(name, bytes) else err}")
        return res[1:]

    def state(self, pid):
        return int(self.call("cuCheckpointProcessGetState", pid)[0])

    def lock(self, pid, timeout_ms):
        a = self.d.CUcheckpointLockArgs()
        a.timeoutMs = timeout_ms
        self.call("cuCheckpointProcessLock", pid, a)

    def checkpoint(self, pid):
        self.call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid, pairs):
        if not pairs:
            return self.call("cuCheckpointProcessRestore", pid, None)
        keep, made = [], []
        try:
            for old, new in pairs:
                p = self.d.CUcheckpointGpuPair()
                for field, text in (("oldUuid", old), ("newUuid", new)):
                    buf = ctypes.create_string_buffer(uuid_bytes(text), 16)
                    keep.append(buf)
                    setattr(p, field, self.d.CUuuid(ctypes.addressof(buf)))
                made.append(p)
            a = self.d.CUcheckpointRestoreArgs()
            a.gpuPairs = made
            a.gpuPairsCount = len(made)
        except (AttributeError, TypeError, ValueError) as e:
            # A cuda-bindings without the pairs (before 13.0.2): the same call through ctypes.
            print(f"cuda-bindings cannot build the restore's GPU pairs ({e}); through ctypes")
            return Ctypes().restore(pid, pairs)
        self.call("cuCheckpointProcessRestore", pid, a)

    def unlock(self, pid):
        self.call("cuCheckpointProcessUnlock", pid, None)


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", Uuid), ("newUuid", Uuid)]


class LockArgs(ctypes.Structure):  # cuda.h's CUcheckpointLockArgs: 64 bytes
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class RestoreArgs(ctypes.Structure):  # cuda.h's CUcheckpointRestoreArgs (CUDA 13): 64 bytes
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - 8)),
        ("reserved1", ctypes.c_uint64),
    ]


class Ctypes:
    """libcuda.so.1 through ctypes; the argument structs are cuda.h's, NULL where optional."""

    name = "ctypes on libcuda.so.1"

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"no CUDA driver API: neither cuda-bindings nor libcuda.so.1 ({e})") from e
        self.call("cuInit", 0)

    def call(self, fn, *args):
        f = getattr(self.lib, fn, None)
        if f is None:
            raise CudaError(f"{fn}: not in this libcuda.so.1 (a driver before 550 has no checkpoint API)")
        err = f(*args)
        if err != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(s))
            raise CudaError(f"{fn}: {s.value.decode() if s.value else err}")

    def state(self, pid):
        s = ctypes.c_int()
        self.call("cuCheckpointProcessGetState", pid, ctypes.byref(s))
        return s.value

    def lock(self, pid, timeout_ms):
        self.call("cuCheckpointProcessLock", pid, ctypes.byref(LockArgs(timeoutMs=timeout_ms)))

    def checkpoint(self, pid):
        self.call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid, pairs):
        if not pairs:
            return self.call("cuCheckpointProcessRestore", pid, None)
        arr = (GpuPair * len(pairs))(*[GpuPair(Uuid.from_buffer_copy(uuid_bytes(o)), Uuid.from_buffer_copy(uuid_bytes(n))) for o, n in pairs])
        a = RestoreArgs(gpuPairs=ctypes.cast(arr, ctypes.POINTER(GpuPair)), gpuPairsCount=len(pairs))
        self.call("cuCheckpointProcessRestore", pid, ctypes.byref(a))

    def unlock(self, pid):
        self.call("cuCheckpointProcessUnlock", pid, None)


def driver_api():
    """cuda-bindings where it has the checkpoint calls, else ctypes."""
    for module in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            driver = __import__(module, fromlist=["_"])
        except ImportError:
            continue
        if hasattr(driver, "cuCheckpointProcessLock"):
            return Bindings(driver)
    return Ctypes()


def cuda(args):
    pairs = [p.split("=", 1) for p in args.map.split(",")] if args.map else []
    try:
        api = driver_api()
        before = STATES.get(api.state(args.pid), "?")
        if args.action == "lock":
            api.lock(args.pid, args.timeout_ms)
        elif args.action == "checkpoint":
            api.checkpoint(args.pid)
        elif args.action == "restore":
            api.restore(args.pid, pairs)
        elif args.action == "unlock":
            api.unlock(args.pid)
        after = STATES.get(api.state(args.pid), "?")
    except CudaError as e:
        print(f"FAIL: cuda {args.action} pid {args.pid}: {e}")
        return 1
    what = f" with the map {args.map}" if pairs else ""
    print(f"cuda {args.action} pid {args.pid}{what} ({api.name}): {before} -> {after}")
    want = {"lock": "locked", "checkpoint": "checkpointed", "restore": "locked", "unlock": "running"}
    if args.action in want and after != want[args.action]:
        print(f"FAIL: cuda {args.action}: the process is {after}, not {want[args.action]}")
        return 1
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("app")
    a.add_argument("--mode", choices=["gpu", "fake"], required=True)
    a.add_argument("--dir", required=True)
    a.add_argument("--alias", required=True)
    a.add_argument("--mib", type=int, default=64)
    a.set_defaults(run=app)
    a = sub.add_parser("ask")
    a.add_argument("dir")
    a.add_argument("word", choices=["ready", "sum", "close", "reopen", "exit"])
    a.add_argument("--timeout", type=float, default=60)
    a.add_argument("--save")
    a.set_defaults(run=ask)
    a = sub.add_parser("same")
    a.add_argument("before")
    a.add_argument("after")
    a.set_defaults(run=same)
    a = sub.add_parser("fds")
    a.add_argument("pid", type=int)
    a.set_defaults(run=fds)
    a = sub.add_parser("cuda")
    a.add_argument("action", choices=["state", "lock", "checkpoint", "restore", "unlock"])
    a.add_argument("pid", type=int)
    a.add_argument("--timeout-ms", type=int, default=30000)
    a.add_argument("--map", default="")
    a.set_defaults(run=cuda)
    args = p.parse_args()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
