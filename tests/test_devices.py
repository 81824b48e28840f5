import os

import pytest

import smartinf
from smartinf.devices import resolve


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
