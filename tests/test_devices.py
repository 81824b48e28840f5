import os

import pytest

import smartinf
from smartinf.pipeline.devices import resolve


def test_paths_become_cpu_devices(tmp_path):
    devices = resolve([str(tmp_path / "a"), smartinf.CpuDevice(tmp_path / "b")])
    assert [d.path for d in devices] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert all(d.kind == "cpu" for d in devices)
    assert resolve(str(tmp_path)) == [smartinf.CpuDevice(str(tmp_path))]


@pytest.mark.parametrize("devices, error, match", [
    ([], ValueError, "non-empty"),
    ([3], TypeError, "not a device"),
    (["x", os.path.abspath("x")], ValueError, "share a directory"),
])
def test_bad_devices(devices, error, match):
    with pytest.raises(error, match=match):
        resolve(devices)


def test_the_device_registry_says_what_each_kind_takes():
    """device/registry.h: one row a kind, read by the pipeline (no kind names elsewhere);
    an unknown kind is refused naming the known ones, and a state format a kind's row does
    not take is refused before any device is made."""
    from smartinf import _native
    rows = {k: _native.device_kind(k) for k in ("cpu", "xrt", "cuda")}
    assert rows["cpu"]["quantized"] and rows["cpu"]["host_budget"] and rows["cpu"]["storage_cap"]
    assert not rows["xrt"]["quantized"] and not rows["xrt"]["split_master"]
    assert "memory_budget" in rows["cuda"]["options"] and not rows["cuda"]["host_budget"]
    assert rows["cpu"]["options"] == () and rows["xrt"]["options"] == ("fpga", "xclbin")
    with pytest.raises(ValueError, match=r"unknown device kind 'tpu' \(known: cpu, xrt, cuda\)"):
        _native.device_kind("tpu")


@pytest.mark.parametrize("settings, what", [({"state_dtype": "int8"}, "int8/int4 states"),
                                            ({"master": "split"}, "a split master")])
def test_a_kind_refuses_the_formats_its_row_does_not_take(tmp_path, monkeypatch, settings, what):
    from smartinf import _build_info
    if not _build_info.XRT:
        pytest.skip("smartinf built without XRT")
    monkeypatch.setenv("XILINX_XRT", str(tmp_path / "no-xrt"))  # refused before XRT is opened
    with pytest.raises(ValueError, match=f"{what} runs on cpu and cuda devices; the SmartSSD"):
        smartinf.Pipeline([smartinf.XrtDevice(str(tmp_path), 0)], smartinf.AdamW(), chunk=1024,
                          slots=2, **settings)
    assert not list(tmp_path.iterdir())  # refused before the device or its files were made


def test_a_kinds_own_options_pass_through_as_text_and_are_checked(tmp_path):
    """device/registry.h: a kind's own options reach its factory as text through the
    pipeline and the binding, which name none of them; an option the kind's row does not
    name is refused (naming those it does) before any device or file is made, and a
    malformed value is refused naming the option."""
    from smartinf import _build_info, _native
    from smartinf.pipeline.devices import NativeDeviceSpec
    from smartinf.pipeline.settings import PipelineSettings

    settings = PipelineSettings.resolve(chunk=1024, slots=2)

    def open_with(kind, options):
        return _native.NativePipeline([NativeDeviceSpec(kind, str(tmp_path), options)], "adamw", 0.0,
                                      settings)

    with pytest.raises(ValueError, match=r"a cpu device takes no option 'memory_budget' \(it takes none\)"):
        open_with("cpu", {"memory_budget": 1 << 20})
    with pytest.raises(ValueError, match=r"a cuda device takes no option 'gpu_memory' \(it takes: gpu, "
                                         r"memory_budget, memory, host_twin\)"):
        open_with("cuda", {"gpu_memory": 1})
    assert not list(tmp_path.iterdir())
    assert _native.option_text(True) == "true" and _native.option_text(7) == "7"
    if not _build_info.CUDA:
        return
    # the cuda factory reads its options before it looks for a GPU
    for options, match in [({"memory_budget": "12x"}, "option memory_budget must be a non-negative integer, got '12x'"),
                           ({"gpu": "-1"}, "option gpu must be a non-negative integer, got '-1'"),
                           ({"host_twin": "yes"}, "option host_twin must be true or false, got 'yes'"),
                           ({"memory": "disk"}, "memory is \"gpu\" or \"host\", got 'disk'")]:
        with pytest.raises(ValueError, match=match):
            open_with("cuda", options)
    assert not list(tmp_path.iterdir())
