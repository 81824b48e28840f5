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
    """Under a launcher (LOCAL_WORLD_SIZE ranks on this host) each rank's update takes its
    share of the cores, less two from 8 on; unless the rank is bound to cores of its own."""
    import os
    from smartinf import _native
    cores = len(os.sched_getaffinity(0))
    alone = cores - 2 if cores >= 8 else cores
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _native.default_compute_threads() == alone
    for ranks in (2, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        share = max(1, cores // ranks) if cores >= os.cpu_count() else cores
        assert _native.default_compute_threads() == (share - 2 if share >= 8 else share)
