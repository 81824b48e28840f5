"""What a pipeline will take is checked before it takes it (smartinf/space.py): a states
directory too small, or a memory budget beyond the host's, is refused before the first
byte, naming what is needed, what is free and what would fit."""
import errno
import os

import pytest
import torch

import smartinf
import smartinf.optim as so
from smartinf.planning import space


def test_a_directory_too_small_is_refused_before_the_first_byte(small_fs):
    """24 MiB of ext4: 1 Mi fp32 params need 24 MiB of fp32 states (two copies); int8 states
    would fit (and are offered), and the directory is left as it was found."""
    model = torch.nn.Linear(1024, 1024, bias=False)
    found = sorted(os.listdir(small_fs))
    with pytest.raises(OSError) as refused:  # (two copies asked: one would fit, all resident)
        so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, copies=2)
    assert refused.value.errno == errno.ENOSPC
    text = str(refused.value)
    assert "1.05 M params need 25.2 MB" in text and "MB free" in text and small_fs in text
    assert "What would fit: " in text and "state_dtype='int8', master='split'" in text
    assert "copies='log' (every instant recoverable; streamed, overlap off): one copy, 12.6 MB" in text
    assert sorted(os.listdir(small_fs)) == found  # nothing written, nothing left
    opt = so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, state_dtype="int8",
                   if_exists="overwrite")  # what it offered fits
    opt.close()


def test_nothing_fits_says_how_many_params_would(small_fs):
    big = [torch.nn.Parameter(torch.zeros(4 << 20, dtype=torch.bfloat16))]
    with pytest.raises(OSError, match="No state format fits: at most .* params would"):
        so.AdamW(big, devices=[small_fs], chunk=1 << 16, master="split")


def test_the_planned_bytes_are_what_the_sub_groups_take(tmp_path):
    """planned_bytes places as add_subgroup does: two devices, balanced by params, and the
    small tensors' device with int4 states."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    sizes, small = [5000, 3000, 4000], [70, 9]
    with smartinf.Pipeline(dirs, state_dtype="int4", chunk=1024, small_sizes=small) as pipe:
        planned = pipe._native.planned_bytes(sizes + small, [False] * 3 + [True] * 2)
        before = [os.path.getsize(d) for d in (*dirs, os.path.join(dirs[0], "fp32-moments"))]
        for n in sizes:
            pipe.add_subgroup(n)
        for n in small:
            pipe.add_subgroup(n, small=True)
        after = [os.path.getsize(os.path.join(d, "states.bin"))
                 for d in (*dirs, os.path.join(dirs[0], "fp32-moments"))]
    assert planned == after and all(planned)
    del before


def test_a_memory_budget_beyond_the_host_is_refused_before_it_is_held(tmp_path):
    budget = space.available_memory() + (8 << 30)
    with pytest.raises(ValueError, match="B of host memory from creation; .*B is available"):
        smartinf.Pipeline(str(tmp_path), memory_budget=budget)
    assert not os.path.exists(tmp_path / "states.bin")


def test_ranks_opening_together_are_checked_together(tmp_path):
    """Ranks of one host opening pipelines at once (``space.ranks_opening``): a budget each
    would be given alone is refused where the ranks together exceed what they measured
    available, before it is held, naming them and each rank's share; given back outside."""
    available = 3 << 30
    with space.ranks_opening(4, available):
        space.check_memory(available // 4, "a budget")  # four of these fit exactly
        with pytest.raises(ValueError, match=r"and 4 ranks of this host open as much at once; "
                                             r"3\.2 GB is available: give a memory_budget of at "
                                             r"most 805\.3 MB in all a rank"):
            smartinf.Pipeline(str(tmp_path), memory_budget=available // 4 + 1)
    assert not os.path.exists(tmp_path / "states.bin")
    with pytest.raises(ValueError, match=r"from creation; .*B is available: give a memory_budget "
                                         r"of at most .*B in all \(the rest"):
        space.check_memory(space.available_memory() + (8 << 30), "a budget")
