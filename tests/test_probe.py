"""python -m smartinf.probe: raw storage bandwidth, host copy, kernel throughput."""
import json
import os

import pytest

from smartinf import _native, defaults
from smartinf.planning import probe, probe_cli

SMALL = ["--size-mib", "8"]


def run_json(capsys, *args):
    assert probe_cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_reports_each_directory_and_leaves_nothing_behind(capsys, disk_dir, tmp_path_factory):
    other = str(tmp_path_factory.mktemp("second"))
    result = run_json(capsys, disk_dir, other, *SMALL)
    assert [s["directory"] for s in result["storage"]] == [disk_dir, other]
    for s in result["storage"]:
        assert s["nbytes"] == 8 << 20
        assert s["engine"] in ("uring", "threads")
        assert s["direct"] is True
        assert s["write_bps"] == pytest.approx(s["nbytes"] / s["write_s"])
        assert s["read_bps"] == pytest.approx(s["nbytes"] / s["read_s"])
        assert s["read_bps"] > 0 and s["write_bps"] > 0
        assert s["mixed_bps"] > 0 and s["phased_bps"] == []  # 8 MiB: no burst fits in half
        assert 0 < s["write_beside_update_bps"] < 1e12  # bytes over seconds of one directory
    assert os.listdir(disk_dir) == [] and os.listdir(other) == []
    kinds = [(k["grad"], k["param"], k["state_dtype"], k["master"]) for k in result["kernel"]]
    bf16 = ("bfloat16", "bfloat16")
    assert kinds == [(g, p, "fp32", "fp32") for g, p in probe.KERNEL_DTYPES] + [
        ("float32", "float16", "int8", "fp32"), (*bf16, "fp32", "fp32"), (*bf16, "int8", "fp32"),
        (*bf16, "int8", "split"), (*bf16, "int4", "fp32"), (*bf16, "int4", "split")]
    # the pipeline's default threads: the usable cores, less two from 8 on
    cores = probe.usable_cores()
    assert [k["threads"] for k in result["kernel"][-5:]] == [cores - 2 if cores >= 8 else cores] * 5
    assert result["triad"]["threads"] == probe.usable_cores() and result["triad"]["bps"] > 0
    for k in result["kernel"]:
        assert k["params_per_s"] == pytest.approx(k["numel"] / k["seconds"])
        per_param = 2 * {("fp32", "fp32"): 12, ("int8", "fp32"): 6.03125,  # read + written
                         ("int8", "split"): 4.03125, ("int4", "fp32"): 5.09375,
                         ("int4", "split"): 3.09375}[
            (k["state_dtype"], k["master"])]
        assert k["state_bps"] == pytest.approx(per_param * k["params_per_s"], rel=1e-5)
    assert result["host_copy"]["bps"] > 0
    assert set(result["build"]) >= {"io_uring", "xrt"}
    if result["gpu"] is not None:  # smartinf with CUDA, and a GPU
        gpu = result["gpu"]
        assert set(gpu["update_pps"]) == {"fp32", "int8", "int4"}
        assert all(v > 0 for v in gpu["update_pps"].values())
        assert gpu["host_to_gpu_bps"] > 0 and gpu["gpu_to_host_bps"] > 0


def test_mix_curve_half_read_half_written(disk_dir):
    """The aggregate bandwidth of a step's mix (half the bytes read, half written): both
    directions in flight at once and alternating bursts of one direction, each burst no
    longer than half the file; bytes per second of a real transfer, nothing left behind."""
    mib = probe.BLOCK
    limit = probe.measure_storage(disk_dir, 16 * mib, mix_bursts=(2 * mib, 4 * mib, 32 * mib))
    assert [burst for burst, _ in limit.phased_bps] == [2 * mib, 4 * mib]  # 32 MiB > half
    for bps in (limit.mixed_bps, *(bps for _, bps in limit.phased_bps)):
        assert 0 < bps < float("inf")
    assert limit.best_phased in limit.phased_bps
    assert limit.sequential_bps == pytest.approx(2 / (1 / limit.read_bps + 1 / limit.write_bps))
    assert min(limit.read_bps, limit.write_bps) <= limit.sequential_bps <= max(limit.read_bps, limit.write_bps)
    assert os.listdir(disk_dir) == []
    without = probe.measure_storage(disk_dir, 16 * mib, mix=False)
    assert (without.mixed_bps, without.phased_bps, without.best_phased) == (0.0, (), (0, 0.0))
    assert limit.write_beside_update_bps == without.write_beside_update_bps == 0.0  # not asked
    with pytest.raises(ValueError, match="multiples of"):
        probe.measure_storage(disk_dir, 16 * mib, mix_bursts=(mib + 1,))


def test_the_queue_depth_is_the_pipelines_unless_given(disk_dir, monkeypatch):
    """The probe measures at the depth the pipeline runs (``SMARTINF_QUEUE_DEPTH``), or at the
    one asked (bench/storage_ring.py's sweep), and records it; a depth below one is refused
    before any file is written."""
    mib = probe.BLOCK
    assert probe.measure_storage(disk_dir, 8 * mib, mix=False).depth == defaults.QUEUE_DEPTH
    monkeypatch.setenv("SMARTINF_QUEUE_DEPTH", "8")
    assert probe.measure_storage(disk_dir, 8 * mib, mix=False).depth == 8
    assert probe.measure_storage(disk_dir, 8 * mib, mix_bursts=(), depth=64).depth == 64
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="depth must be a positive int"):
            probe.measure_storage(disk_dir, 8 * mib, depth=bad)
    assert os.listdir(disk_dir) == []


def test_the_write_beside_the_hosts_update(disk_dir):
    """The write a background durable commit gets while the host's update runs back to back
    (1 Mi params of fp32 states here): the same bytes as the plain write, a real transfer,
    nothing left behind; a write that fails stops the update and raises."""
    limit = probe.measure_storage(disk_dir, 16 * probe.BLOCK, mix=False, update_numel=1 << 20)
    assert 0 < limit.write_beside_update_bps < 1e12
    assert os.listdir(disk_dir) == []
    with pytest.raises(OSError, match="missing"):
        _native.time_storage_beside_update(os.path.join(disk_dir, "missing", "f"), probe.BLOCK,
                                           "auto", probe.BLOCK, 4, 1 << 16, 0, 0, "fp32", 2)


def test_engine_choice_is_reported(capsys, disk_dir):
    result = run_json(capsys, disk_dir, *SMALL, "--engine", "threads")
    assert result["engine_requested"] == "threads"
    assert result["storage"][0]["engine"] == "threads"


def test_size_is_rounded_up_to_whole_blocks(disk_dir):
    limit = probe.measure_storage(disk_dir, 3 * probe.BLOCK + 1)
    assert limit.nbytes == 4 * probe.BLOCK


def test_table_names_directory_and_kernels(capsys, disk_dir):
    assert probe_cli.main([disk_dir, *SMALL]) == 0
    out = capsys.readouterr().out
    assert disk_dir in out
    for grad, param in probe.KERNEL_DTYPES:
        assert f"{grad}/{param}" in out
    assert "host memory copy" in out


def test_no_direct_io_is_flagged_as_buffered(capsys, no_direct_dir, caplog):
    result = run_json(capsys, no_direct_dir, *SMALL)
    assert result["storage"][0]["direct"] is False
    assert any("no O_DIRECT" in r.getMessage() for r in caplog.records)
    assert probe_cli.main([no_direct_dir, *SMALL]) == 0
    assert "buffered: no O_DIRECT here" in capsys.readouterr().out


@pytest.mark.parametrize("make, message", [
    (lambda root: os.path.join(root, "missing"), "does not exist"),
    (lambda root: open(os.path.join(root, "file"), "w").close() or os.path.join(root, "file"),
     "not a directory"),
])
def test_bad_directory_is_a_clear_error(capsys, tmp_path, make, message):
    path = make(str(tmp_path))
    assert probe_cli.main([path, *SMALL]) == 1
    err = capsys.readouterr().err
    assert message in err and path in err


def test_too_little_space_is_refused_before_writing(disk_dir):
    free = __import__("shutil").disk_usage(disk_dir).free
    with pytest.raises(OSError, match="GiB free"):
        probe.measure_storage(disk_dir, free + (1 << 30))
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("args", [["--size-mib", "0"], ["--repeats", "0"], ["--engine", "spdk"]])
def test_bad_options_exit_with_usage_error(args):
    with pytest.raises(SystemExit) as e:
        probe_cli.main(args)
    assert e.value.code == 2


def test_bad_arguments_to_functions():
    with pytest.raises(ValueError, match="engine"):
        probe.measure_storage("/tmp", 1 << 20, engine="spdk")
    with pytest.raises(ValueError, match="nbytes"):
        probe.measure_storage("/tmp", 0)
    with pytest.raises((TypeError, ValueError), match="float64"):
        probe.measure_kernel(1024, "float64", "float32")
