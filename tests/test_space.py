"""What a pipeline will take is checked before it takes it (smartinf/space.py): a states
directory too small, or a memory budget beyond the host's, is refused before the first
byte, naming what is needed, what is free and what would fit."""
import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np

import pytest
import torch

import smartinf
import smartinf.optim as so
from smartinf.planning import space


def test_a_directory_too_small_is_refused_before_the_first_byte(small_fs):
    """24 MiB of ext4: 1 Mi fp32 params need 24 MiB of fp32 states (two copies); what it offers
    instead each runs when followed (fp32 params: no split master; no log, whose spare
    extents and gradients do not fit either), and the directory is left as it was found."""
    model = torch.nn.Linear(1024, 1024, bias=False)
    found = sorted(os.listdir(small_fs))
    with pytest.raises(OSError) as refused:  # (two copies asked: one would fit, all resident)
        so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, copies=2)
    assert refused.value.errno == errno.ENOSPC
    text = str(refused.value)
    assert "1.05 M params need 25.2 MB" in text and "MB free" in text and small_fs in text
    assert "What would fit: copies=1 (" in text and "state_dtype='int8', master='fp32'" in text
    assert "split" not in text and "copies='log'" not in text
    assert sorted(os.listdir(small_fs)) == found  # nothing written, nothing left
    offers = re.findall(r"(copies=\S+? |state_dtype='\w+', master='\w+')", text.split("What would fit:")[1])
    assert len(offers) == 2
    for offer in offers:  # each one runs a step and commits it
        opt = so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, if_exists="overwrite",
                       **eval(f"dict({offer.strip()})"))
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        opt.close()


def test_bf16_params_are_offered_a_split_master_that_runs(small_fs):
    model = torch.nn.Linear(2048, 1024, bias=False).to(torch.bfloat16)
    with pytest.raises(OSError) as refused:
        so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, state_dtype="int8", copies=2)
    text = str(refused.value)
    assert "state_dtype='int4', master='split'" in text
    offers = re.findall(r"(copies=\S+? |state_dtype='\w+', master='\w+')", text.split("What would fit:")[1])
    for offer in offers:
        opt = so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 16, if_exists="overwrite",
                       **{"state_dtype": "int8", "copies": 2, **eval(f"dict({offer.strip()})")})
        model(torch.randn(2, 2048, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.close()


def leave_free(directory: str, nbytes: int) -> None:
    """Fills ``directory``'s file system but ``nbytes`` (as ``shutil.disk_usage`` counts)."""
    with open(os.path.join(directory, "filler"), "ab") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(directory).free - nbytes)
    assert shutil.disk_usage(directory).free == nbytes


def test_room_for_the_states_but_not_the_manifest_is_refused_at_creation(small_fs, tmp_path):
    """Issue 88: a disk of exactly the states (and the open's lock and manifest) passed, and
    the first durable commit failed writing its manifest. Refused at creation, naming bytes."""
    run, sizes = os.path.join(small_fs, "run"), [250_000]
    with smartinf.Pipeline(str(tmp_path), subgroup_sizes=sizes, commit_every=10) as pipe:
        pipe.add_subgroup(sizes[0])
    states = os.path.getsize(tmp_path / "states.bin")
    os.mkdir(run)
    leave_free(small_fs, states + 2 * os.statvfs(small_fs).f_frsize)  # + the open's lock and manifest
    with pytest.raises(OSError, match=r"need 6\.0 MB in .*run .* and their commits .*B more \(the "
                                      r"manifest.*\): [\d,]+ B, and that file system has "
                                      r"[\d,]+ B free") as refused:
        smartinf.Pipeline(run, subgroup_sizes=sizes, commit_every=10)
    assert refused.value.errno == errno.ENOSPC and os.listdir(run) == []


def test_a_full_disk_is_refused_before_the_open_writes(small_fs):
    """Nothing free: refused naming the bytes the open writes (the core said "cannot write the
    manifest", naming none, and left its lock and states file)."""
    run = os.path.join(small_fs, "run")
    os.mkdir(run)
    leave_free(small_fs, 0)
    with pytest.raises(OSError, match=r"opening .*run writes a lock and a manifest there first: "
                                      r"2\.0 kB, and that file system has 0 B free"):
        smartinf.Pipeline(run, subgroup_sizes=[1000])
    assert os.listdir(run) == []


def test_a_reopen_counts_what_its_directory_holds(small_fs):
    """A run stopped before its first durable commit (its manifest records no sub-group, its
    states file holds them) on a disk then filled but for a manifest's blocks: reopened, its
    states file's bytes are not asked again."""
    run = os.path.join(small_fs, "run")
    stopped = textwrap.dedent(f"""
        import os, smartinf
        pipe = smartinf.Pipeline({run!r}, subgroup_sizes=[250_000], commit_every=10)
        pipe.add_subgroup(250_000)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", stopped], check=True)
    assert os.path.getsize(os.path.join(run, "states.bin")) > 6_000_000
    leave_free(small_fs, 4 * os.statvfs(small_fs).f_frsize)
    with smartinf.Pipeline(run, subgroup_sizes=[250_000], commit_every=10) as pipe:
        pipe.add_subgroup(250_000)
        with pipe.step():
            pipe.update(0, np.ones(250_000, np.float32), np.empty(250_000, np.float32))
    with smartinf.Pipeline(run, commit_every=10) as pipe:
        pipe.add_subgroup(250_000)
        assert pipe.durable_step_count == 1


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
