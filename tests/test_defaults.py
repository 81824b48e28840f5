import numpy as np
import pytest

import smartinf
from smartinf import defaults


def test_environment_sets_defaults_and_arguments_win(disk_dir, monkeypatch):
    monkeypatch.setenv("SMARTINF_IO", "threads")
    monkeypatch.setenv("SMARTINF_CHUNK", "4096")
    monkeypatch.setenv("SMARTINF_SLOTS", "2")
    assert (defaults.io(), defaults.chunk(), defaults.slots()) == ("threads", 4096, 2)
    with smartinf.Pipeline(disk_dir) as pipe:
        assert pipe.engine == "threads"
        pipe.add_subgroup(10000)
        with pipe.step():
            pipe.update(0, np.zeros(10000, np.float32), np.empty(10000, np.float32))
        assert pipe.stats["chunks"] == 3  # 10000 params in 4096-param chunks
    with pytest.raises(ValueError, match="chunk 4096, not 8192"):
        smartinf.Pipeline(disk_dir, chunk=8192)  # the explicit argument wins over the env


@pytest.mark.parametrize("name, value, match", [
    ("SMARTINF_IO", "aio", "SMARTINF_IO='aio'"),
    ("SMARTINF_SLOTS", "many", "SMARTINF_SLOTS='many' is not an integer"),
    ("SMARTINF_OVERLAP", "yes", "SMARTINF_OVERLAP='yes': expected 1"),
])
def test_bad_environment_is_named(disk_dir, monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        smartinf.Pipeline(disk_dir)


def test_overlap_from_the_environment_and_a_bad_argument(disk_dir, monkeypatch):
    monkeypatch.setenv("SMARTINF_OVERLAP", "0")
    with smartinf.Pipeline(disk_dir) as pipe:
        assert pipe.settings.overlap is False
    with smartinf.Pipeline(disk_dir, overlap=True) as pipe:  # the argument wins
        assert pipe.settings.overlap is True
    with pytest.raises(TypeError, match="overlap must be a bool, got str"):
        smartinf.Pipeline(disk_dir, overlap="no")


def test_ranks_of_one_host_share_its_cores(monkeypatch):
    """Under a launcher (its ranks on this host: torchrun's LOCAL_WORLD_SIZE, the deepspeed
    launcher's LOCAL_SIZE, Open MPI's, as defaults.local_ranks and the native pool read
    them alike) each rank's update takes its share of the cores, less two from 8 on; unless
    the rank is bound to cores of its own."""
    import os
    from smartinf import _native, defaults
    cores = len(os.sched_getaffinity(0))
    alone = cores - 2 if cores >= 8 else cores
    for name in defaults.LOCAL_RANKS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert _native.default_compute_threads() == alone and defaults.local_ranks() == 1
    for name in defaults.LOCAL_RANKS_VARIABLES:
        for ranks in (2, 4):
            monkeypatch.setenv(name, str(ranks))
            share = max(1, cores // ranks) if cores >= os.cpu_count() else cores
            assert _native.default_compute_threads() == (share - 2 if share >= 8 else share), name
            assert defaults.local_ranks() == ranks, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's first
    assert defaults.local_ranks() == 2


def _allowed_list(tid: int) -> list:
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    return _native_cpu_list(line.split(":", 1)[1].strip())


def _native_cpu_list(text: str) -> list:
    cores = []
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def test_each_rank_of_a_host_pins_its_update_to_a_slice_of_its_own(monkeypatch, disk_dir):
    """LOCAL_WORLD_SIZE ranks on an unbound host: rank r's update threads run on the r-th
    of that many equal slices of the cores (NUMA-node order), the slices disjoint; the
    pool's threads are pinned there; SMARTINF_CORES overrides; a bound rank is left as its
    launcher bound it."""
    import os
    import subprocess
    import sys
    from smartinf import _native
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("SMARTINF_CORES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _native.rank_cores() == []  # one rank: no pinning
    if len(allowed) == os.cpu_count():
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        slices = []
        for rank in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            slices.append(_native.rank_cores())
        assert all(len(s) == max(1, len(allowed) // 2) for s in slices)
        assert set(slices[0]) <= set(allowed) and set(slices[1]) <= set(allowed)
        if len(allowed) >= 2:
            assert not set(slices[0]) & set(slices[1])
        # the pool's workers are pinned to rank 1's slice
        with smartinf.Pipeline(disk_dir, compute_threads=2):
            pool = [int(t) for t in os.listdir("/proc/self/task")
                    if open(f"/proc/self/task/{t}/comm").read().strip() == "smartinf-pool"]
            assert pool and all(_allowed_list(t) == sorted(slices[1]) for t in pool)
    monkeypatch.setenv("SMARTINF_CORES", str(allowed[0]))
    assert _native.rank_cores() == [allowed[0]]
    assert _native.default_compute_threads() == 1
    for bad in ("x", "3-1", "99999"):
        monkeypatch.setenv("SMARTINF_CORES", bad)
        with pytest.raises(ValueError, match="SMARTINF_CORES"):
            _native.rank_cores()
    monkeypatch.delenv("SMARTINF_CORES")
    # a rank its launcher bound (affinity narrower than the host) is left alone
    code = ("import os; os.sched_setaffinity(0, {%d}); from smartinf import _native; "
            "print(_native.rank_cores())" % allowed[0])
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", LOCAL_RANK="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
