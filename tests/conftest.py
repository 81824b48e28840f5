import errno
import fcntl
import os
import random
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import smartinf

SHM = "/dev/shm"
# pytest-xdist (make test): each worker's torch takes its share of the cores, not all of them
# (its threads would spin waiting for each other while another worker's hold the cores).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) //
                                                     int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Updates during backward start by default only where backward runs on a GPU; the tests
# exercise them on the CPU too (inherited by the DeepSpeed runs' processes).
os.environ.setdefault("SMARTINF_SPECULATE_ON_CPU", "1")
# torch.compile's kernel cache is keyed without ATEN_CPU_CAPABILITY: a run forced to AVX2
# (docs/testing.md) would reuse this CPU's AVX-512 kernels (or leave its own for the next
# run), and a compiled forward gave wrong values and corrupted the heap. Each forced
# capability compiles into a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        "/tmp", f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


def free_port() -> int:
    """A TCP port nothing listens on now, for a launch's rendezvous (torchrun's
    --master_port): tests running at once (pytest-xdist's workers) each get their own. Below
    the kernel's ephemeral range: a port the kernel picked for us there (bind to 0) could be
    taken by another launch's outgoing connection before torchrun listens on it (EADDRINUSE,
    seen once in CI)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low // 3), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port below {low}")


def files_digest(root, but: tuple = ()) -> dict:
    """Every file under ``root`` but those named ``but``: its bytes' digest (what a refusal
    must leave as it was)."""
    import hashlib
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(root).rglob("*")) if f.is_file() and f.name not in but}


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A directory that ``make(directory)`` filled once for all of this run's pytest-xdist
    workers (a launch whose results several tests read): the first worker to ask makes it,
    the others wait for it (a lock) and find it made. (xdist's loadgroup would keep the tests
    on one worker instead, but pytest 9.2 ignores its renamed node ids.) A make that fails
    is tried again by the next to ask."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's, above each worker's own
    directory = root / f"made-{name}"
    with open(root / f"made-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / ".made").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            (directory / ".made").touch()
    return directory


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk (O_DIRECT works there)."""
    if _fs_type(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs; the O_DIRECT path needs a real disk")
    return str(tmp_path)


@pytest.fixture
def shm_dir(tmp_path_factory):
    """A directory on tmpfs (/dev/shm)."""
    if not os.path.isdir(SHM) or _fs_type(SHM) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = tmp_path_factory.mktemp("x")  # unique name, reused under /dev/shm
    target = os.path.join(SHM, f"smartinf-test-{os.getpid()}-{path.name}")
    os.makedirs(target)
    yield target
    subprocess.run(["rm", "-rf", target], check=False)


@pytest.fixture
def no_direct_dir(tmp_path):
    """A directory whose file system refuses O_DIRECT, to exercise the buffered fallback.

    tmpfs refused it before Linux 6.6 and accepts it since; ramfs still refuses it, so
    where /dev/shm takes O_DIRECT a ramfs is mounted (root only)."""
    if os.path.isdir(SHM) and not _direct_io_works(SHM):
        target = os.path.join(SHM, f"smartinf-test-{os.getpid()}-{tmp_path.name}")
        os.makedirs(target)
        yield target
        subprocess.run(["rm", "-rf", target], check=False)
        return
    target = tmp_path / "ramfs"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "smartinf-test", str(target)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"{SHM} accepts O_DIRECT (Linux >= 6.6 tmpfs) and mounting a ramfs "
                    f"failed ({mounted.stderr.strip() or 'not root'}): no file system "
                    f"without O_DIRECT to test the fallback on")
    try:
        yield str(target)
    finally:
        subprocess.run(["umount", str(target)], check=False)


def _direct_io_works(directory) -> bool:
    path = os.path.join(directory, f".smartinf-direct-{os.getpid()}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.remove(path)


def _fs_type(path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def uring_works() -> bool:
    if not smartinf.io_uring_built():
        return False
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with smartinf.Pipeline(d, chunk=1024, slots=1, io="auto") as p:
            return p.engine == "uring"


ENGINES = [pytest.param("uring", marks=pytest.mark.skipif(
    not uring_works(), reason="io_uring is unavailable here (not built, seccomp or io_uring_disabled)")),
    "threads"]


class TorchReference:
    """The same sub-groups and gradients through torch.optim, for comparison."""

    def __init__(self, inits, rule):
        self.params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in inits]
        kind = torch.optim.AdamW if isinstance(rule, smartinf.AdamW) else torch.optim.Adam
        self.opt = kind(self.params, lr=rule.lr, betas=rule.betas, eps=rule.eps,
                        weight_decay=rule.weight_decay)

    def step(self, grads, lr=None):
        for p, g in zip(self.params, grads):
            p.grad = torch.from_numpy(np.asarray(g, dtype=np.float32).copy())
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        self.opt.step()

    def states(self, i):
        p = self.params[i]
        s = self.opt.state[p]
        return {"param": p.detach().numpy(), "exp_avg": s["exp_avg"].numpy(),
                "exp_avg_sq": s["exp_avg_sq"].numpy()}


def wide(rng, n, signed):
    """Values over 12 orders of magnitude, a few exact zeros (the quantized formats' tests)."""
    x = (10.0 ** rng.uniform(-12, 0, n)).astype(np.float32)
    if signed:
        x *= rng.choice([-1, 1], n).astype(np.float32)
    x[rng.choice(n, 5, replace=False)] = 0
    return x


def assert_stored_as(disk_dir, rule, state_dtype, chunk, states, ref):
    """``states`` written into a new directory of ``state_dtype`` (one sub-group, chunks of
    ``chunk``): each chunk's extent in states.bin is byte for byte ``ref.extent(lo, hi)``, the
    reference's layout (quant8_reference, quant4_reference)."""
    n = len(states["param"])
    with smartinf.Pipeline(disk_dir, rule, chunk=chunk, state_dtype=state_dtype) as pipe:
        pipe.add_subgroup(n)
        with pipe.step():
            pipe.write_states(0, {k: states[k] for k in ("param",) + rule.state_names}, steps=1)
    with open(f"{disk_dir}/manifest") as f:
        sg = next(line.split() for line in f if line.startswith("sg "))
    offset, copy = int(sg[3]), int(sg[4])
    extent = -(-len(ref.extent(0, chunk)) // 4096) * 4096
    with open(f"{disk_dir}/states.bin", "rb") as f:
        data = f.read()
    for c, lo in enumerate(range(0, n, chunk)):
        expected = ref.extent(lo, min(lo + chunk, n))
        at = offset + 2 * c * extent + copy * (-(-len(expected) // 4096) * 4096)
        assert data[at:at + len(expected)] == expected, f"chunk {c}"


def assert_close_fp32(actual, expected, what=""):
    """fp32 agreement with torch: <= 1e-6 relative.

    Relative to max(|x_i|, mean |x|): torch's vectorised CPU kernels use FMA (lerp,
    addcmul) where our portable kernel rounds twice, a 1-ulp difference that cancellation
    in exp_avg can leave on elements much smaller than the rest of the tensor.
    """
    actual = np.asarray(actual, np.float64).ravel()
    expected = np.asarray(expected, np.float64).ravel()
    err = np.abs(actual - expected)
    bound = 1e-6 * np.maximum(np.abs(expected), np.abs(expected).mean()) + 1e-30
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (f"{what}: element {worst}: {actual[worst]!r} vs "
                                  f"{expected[worst]!r} (rel {err[worst] / max(abs(expected[worst]), 1e-30):.2e})")


def step_traffic_per_param(directory, rule, n, grad, out, **settings):
    """Bytes per param each link moved in one step of one sub-group of ``n`` params (its
    states written at add_subgroup left out)."""
    with smartinf.Pipeline(str(directory), rule, **settings) as pipe:
        pipe.add_subgroup(n)
        before = pipe.stats
        with pipe.step():
            pipe.update(0, grad, out)
        after = pipe.stats
    return {k: (after[k] - before[k]) / n for k in
            ("storage_read", "storage_write", "host_to_device", "device_to_host")}


def open_with_subgroups(dirs, rule, sizes, chunk, **kwargs):
    """A Pipeline with sub-groups of `sizes` (seeded random inits; resumed when the
    directories hold them), closed again if adding them fails (it holds their locks)."""
    pipe = smartinf.Pipeline(dirs, rule, chunk=chunk, slots=2, **kwargs)
    rng = np.random.default_rng(0)
    try:
        for n in sizes:
            pipe.add_subgroup(n, init=rng.standard_normal(n).astype(np.float32))
    except BaseException:
        pipe.close()
        raise
    return pipe


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB ext4 file system, loop-mounted (root only)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("a full-disk test needs root and mkfs.ext4 to loop-mount a small ext4 image")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(24 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here: {mounted.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=False)


def fill(directory):
    """Writes a file until the file system is full; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 4096, 1):  # down to the last byte ext4 gives out
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
