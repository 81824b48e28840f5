"""The SmartSSD device (XRT) as far as XRT's `noop` emulation goes, and its input checks.

Under XCL_EMULATION_MODE=noop XRT opens a device and allocates, maps and syncs P2P and
normal buffer objects without an FPGA, so the pipeline's data movement through them
(states written back from the P2P slots, loaded into them again) runs for real; there
is no xclbin, so the kernel stage reports itself unavailable, and nothing stored may be
lost by that. Running the kernels needs the hardware (test at the end, skipped here).
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import smartinf

NOOP_SHIM = "libxrt_noop.so.2"


def noop_shim():
    for d in ("/usr/lib/x86_64-linux-gnu", "/opt/xilinx/xrt/lib", "/usr/lib64", "/usr/lib"):
        if os.path.exists(os.path.join(d, NOOP_SHIM)):
            return os.path.join(d, NOOP_SHIM)
    return None


@pytest.fixture
def noop_env(tmp_path):
    """Environment for XRT's noop emulation; XRT looks for the shim in $XILINX_XRT/lib,
    where Debian's libxrt1 does not put it, so a prefix with a link to it is made."""
    if not smartinf.build_info()["xrt"]:
        pytest.skip("smartinf was built without XRT (libxrt-dev not found at build time)")
    shim = noop_shim()
    if shim is None:
        pytest.skip(f"XRT's noop emulation shim ({NOOP_SHIM}) is not installed")
    prefix = tmp_path / "xrt"
    (prefix / "lib").mkdir(parents=True)
    os.symlink(shim, prefix / "lib" / NOOP_SHIM)
    return dict(os.environ, XILINX_XRT=str(prefix), XCL_EMULATION_MODE="noop")


SCENARIO = textwrap.dedent("""
    import json, sys
    import numpy as np, smartinf
    d = sys.argv[1]
    x = np.random.default_rng(0).standard_normal(3008).astype(np.float32)
    pipe = smartinf.Pipeline([smartinf.XrtDevice(d, 0)], smartinf.AdamW(), chunk=1024, slots=2)
    try:
        pipe.add_subgroup(3000)
        r0 = "accepted"
    except ValueError as e:
        r0 = str(e)
    sg = pipe.add_subgroup(3008, init=x)           # WRITEBACK from the P2P slots
    st = pipe.read_states(sg)                       # LOAD into them
    r = {"unaligned": r0, "describe": repr(pipe), "init_equal": bool(np.array_equal(st["param"], x)),
         "moments_zero": bool(not st["exp_avg"].any() and not st["exp_avg_sq"].any()),
         "written": pipe.stats["storage_write"], "read": pipe.stats["storage_read"]}
    try:
        with pipe.step():
            pipe.update(sg, np.ones(3008, np.float32), np.empty(3008, np.float16)).wait()
        r["update"] = "ran"
    except RuntimeError as e:
        r["update"] = str(e)
    r["after_equal"] = bool(np.array_equal(pipe.read_states(sg)["param"], x))
    r["step"] = pipe.step_count
    pipe.close()
    pipe = smartinf.Pipeline([smartinf.XrtDevice(d, 0)], smartinf.AdamW(), chunk=1024, slots=2)
    sg = pipe.add_subgroup(3008)
    r["resumed"] = pipe.resumed(sg)
    r["resumed_equal"] = bool(np.array_equal(pipe.read_states(sg)["param"], x))
    pipe.close()
    print(json.dumps(r))
""")


def test_noop_data_movement_through_xrt_buffers(noop_env, disk_dir):
    done = subprocess.run([sys.executable, "-c", SCENARIO, disk_dir], env=noop_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert "a sub-group of 3000 params on xrt:" in r["unaligned"] and "multiple of 16" in r["unaligned"]
    assert r["init_equal"] and r["moments_zero"]
    assert r["written"] >= 3008 * 12 and r["read"] >= 3008 * 12
    assert r["update"].startswith("kernel stage unavailable on xrt:")
    assert "xclbin" in r["update"]
    assert r["after_equal"] and r["step"] == 0  # the failed step stored nothing
    assert r["resumed"] and r["resumed_equal"]
    # XRT's emulation maps unaligned memory: the store says it fell back to buffered I/O.
    assert "not page aligned" in done.stderr


def test_xrt_device_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="PCIe BDF"):
        smartinf.XrtDevice(str(tmp_path), "3b:00")
    with pytest.raises(ValueError, match=">= 0"):
        smartinf.XrtDevice(str(tmp_path), -1)
    with pytest.raises(TypeError, match="fpga"):
        smartinf.XrtDevice(str(tmp_path), 1.5)
    with pytest.raises(FileNotFoundError, match="make -C hls_kernels"):
        smartinf.XrtDevice(str(tmp_path), "0000:3b:00.1", xclbin=str(tmp_path / "none.xclbin"))
    assert smartinf.XrtDevice(str(tmp_path), "0000:3b:00.1").native_spec is not None


def test_missing_xrt_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("XILINX_XRT", raising=False)
    expected = "XILINX_XRT is not set" if smartinf.build_info()["xrt"] else "built without XRT"
    with pytest.raises(OSError, match=expected):
        smartinf.Pipeline([smartinf.XrtDevice(str(tmp_path))])
    assert not os.listdir(tmp_path)  # nothing was created


@pytest.mark.skipif(not os.environ.get("SMARTINF_SMARTSSD_XCLBIN"),
                    reason="needs a Samsung SmartSSD (KU15P FPGA + NVMe) with XRT, and "
                           "SMARTINF_SMARTSSD_XCLBIN=<hls_kernels build>; SMARTINF_SMARTSSD_DIR "
                           "a directory on its NVMe")
def test_smartssd_update_equals_cpu_device(tmp_path):
    """On the hardware: one AdamW step on the SmartSSD equals the cpu device bit for bit."""
    xclbin, ssd_dir = os.environ["SMARTINF_SMARTSSD_XCLBIN"], os.environ["SMARTINF_SMARTSSD_DIR"]
    x = np.random.default_rng(1).standard_normal(1 << 16).astype(np.float32)
    g = np.random.default_rng(2).standard_normal(1 << 16).astype(np.float32)
    outs = []
    for dev in (smartinf.XrtDevice(os.path.join(ssd_dir, "smartinf-test"), 0, xclbin=xclbin),
                smartinf.CpuDevice(str(tmp_path))):
        with smartinf.Pipeline([dev], smartinf.AdamW(), chunk=1 << 14) as pipe:
            sg = pipe.add_subgroup(x.size, init=x)
            out = np.empty(x.size, np.float16)
            with pipe.step():
                pipe.update(sg, g, out).wait()
            outs.append((out, pipe.read_states(sg)))
    assert np.array_equal(outs[0][0].view(np.uint16), outs[1][0].view(np.uint16))
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert np.array_equal(outs[0][1][name].view(np.uint32), outs[1][1][name].view(np.uint32))


ERRORS = textwrap.dedent("""
    import json, os, sys
    import smartinf
    d = sys.argv[1]
    bad = os.path.join(d, "bad.xclbin")
    with open(bad, "wb") as f:
        f.write(b"not an xclbin" * 64)
    r = {}
    for name, dev in (("bdf", smartinf.XrtDevice(os.path.join(d, "a"), "0000:3b:00.1")),
                      ("xclbin", smartinf.XrtDevice(os.path.join(d, "b"), 0, xclbin=bad))):
        try:
            smartinf.Pipeline([dev]).close()
            r[name] = "opened"
        except RuntimeError as e:
            r[name] = str(e)
    print(json.dumps(r))
""")


def test_noop_errors_name_the_fix(noop_env, tmp_path):
    done = subprocess.run([sys.executable, "-c", ERRORS, str(tmp_path)], env=noop_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["bdf"].startswith("cannot open XRT device 0000:3b:00.1") and "xbutil examine" in r["bdf"]
    assert r["xclbin"].startswith("cannot load") and "xilinx_u2_gen3x4_xdma_gc_2_202110_1" in r["xclbin"]


# -- finding SmartSSDs in sysfs (a made-up sysfs tree: two cards and a plain NVMe drive) --
from smartinf.pipeline import smartssd  # noqa: E402


def fake_sysfs(root, data_dir):
    """Card A: FPGA 0000:03:00.1 + nvme0 behind switch 0000:01:00.0; card B: FPGA
    0000:13:00.1 + nvme1 behind 0000:11:00.0; nvme2 alone. data_dir lives on nvme0n1."""
    devices = root / "devices" / "pci0000:00"

    def function(path, vendor, cls="0x000000"):
        path.mkdir(parents=True)
        (path / "vendor").write_text(vendor + "\n")
        (path / "class").write_text(cls + "\n")
        link = root / "bus" / "pci" / "devices" / path.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
        return path

    def nvme(path, name):
        ctrl = path / "nvme" / name
        (ctrl / f"{name}n1").mkdir(parents=True)
        link = root / "class" / "nvme" / name
        link.mkdir(parents=True)
        (link / "device").symlink_to(path)
        (link / f"{name}n1").mkdir()
        return ctrl / f"{name}n1"

    for up, fpga, drive, name in (("0000:01:00.0", "0000:03:00.1", "0000:04:00.0", "nvme0"),
                                  ("0000:11:00.0", "0000:13:00.1", "0000:14:00.0", "nvme1")):
        switch = devices / "0000:00:01.0" / up
        function(switch / "0000:02:00.0" / fpga.replace(".1", ".0"), "0x10ee")
        function(switch / "0000:02:00.0" / fpga, "0x10ee")
        ns = nvme(function(switch / "0000:02:01.0" / drive, "0x144d", "0x010802"), name)
        if name == "nvme0":
            st = os.stat(data_dir)
            block = root / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            block.parent.mkdir(parents=True)
            block.symlink_to(ns)
    nvme(function(devices / "0000:00:02.0" / "0000:21:00.0", "0x144d", "0x010802"), "nvme2")
    mounts = root / "mounts"
    mounts.write_text("/dev/nvme0n1 /mnt/ssd-a ext4 rw 0 0\n/dev/nvme1n1p1 /mnt/ssd-b xfs rw 0 0\n"
                      "/dev/nvme2n1 /data ext4 rw 0 0\n")
    return str(root), str(mounts)


def test_discover_pairs_each_fpga_with_its_own_drive(tmp_path):
    sysfs, mounts = fake_sysfs(tmp_path / "sys", tmp_path)
    cards = smartssd.discover(sysfs, mounts)
    assert [(c.fpga, c.nvme, c.block_devices, c.mounts) for c in cards] == [
        ("0000:03:00.1", "nvme0", ["/dev/nvme0n1"], ["/mnt/ssd-a"]),
        ("0000:13:00.1", "nvme1", ["/dev/nvme1n1"], ["/mnt/ssd-b"])]  # nvme2 has no FPGA
    devices = smartinf.XrtDevice.discover(sysfs=sysfs, mounts_file=mounts)
    assert [(d.path, d.fpga) for d in devices] == [("/mnt/ssd-a/smartinf", "0000:03:00.1"),
                                                   ("/mnt/ssd-b/smartinf", "0000:13:00.1")]


def test_storage_directory_must_be_on_the_cards_own_drive(tmp_path):
    sysfs, _ = fake_sysfs(tmp_path / "sys", tmp_path)
    smartssd.check_pairing(str(tmp_path / "run"), "0000:03:00.1", sysfs)  # same card: fine
    with pytest.raises(ValueError, match="not on the NVMe drive of the SmartSSD with FPGA 0000:13:00.1"):
        smartssd.check_pairing(str(tmp_path / "run"), "0000:13:00.1", sysfs)
    smartssd.check_pairing(str(tmp_path), "0000:99:00.1", sysfs)  # unknown card: XRT decides


PROBE = textwrap.dedent("""
    import json, sys
    from smartinf.planning import probe_cli, probe_devices
    r = probe_devices.measure_smartssd(sys.argv[1], 0, 8 << 20)
    print(json.dumps(r))
    print(probe_cli.format_report({"build": {"io_uring": True, "xrt": True}, "engine_requested": "auto",
                               "storage": [], "host_copy": {"bps": 1e9, "nbytes": 1 << 20, "repeats": 1},
                               "kernel": [], "smartssd": [r]}))
""")


def test_probe_measures_a_smartssd_through_xrt(noop_env, disk_dir):
    done = subprocess.run([sys.executable, "-c", PROBE, disk_dir], env=noop_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.splitlines()[0])
    assert r["emulation"] == "noop" and r["direct"] is False  # emulation maps unaligned memory
    for k in ("p2p_read_bps", "p2p_write_bps", "host_to_fpga_bps", "fpga_to_host_bps"):
        assert r[k] > 0
    assert "[noop emulation]" in done.stdout
    assert not [f for f in os.listdir(disk_dir) if f.startswith(".smartinf")]  # probe file removed


def test_the_smartssd_build_names_every_kernel_and_port_of_kernels_cpp():
    """hls_kernels/Makefile's KERNELS and smartssd.cfg's connectivity name the top functions
    of kernels.cpp and their AXI ports as they are spelled there: v++ refuses a link whose
    `sp=` names a port a kernel lacks (it named adam8's `v_codes` `w_codes` until this test),
    after hours of synthesis."""
    import re
    hls = os.path.join(os.path.dirname(__file__), "..", "hls_kernels")
    source = open(os.path.join(hls, "kernels.cpp")).read().replace("\\\n", " ")
    ports_of_macro = {
        m.group(1): re.findall(r"Beat\*\s*(\w+)", m.group(2))
        for m in re.finditer(r"#define (SMARTINF_\w+)\(NAME[^)]*\)\s*extern \"C\" void NAME\(([^)]*)\)",
                             source)}
    tops = {m.group(2): ports_of_macro[m.group(1)]
            for m in re.finditer(r"^(SMARTINF_\w+)\((smartinf_\w+)", source, re.M)}
    assert tops and all(tops.values())
    make = open(os.path.join(hls, "Makefile")).read().replace("\\\n", " ")
    kernels = re.search(r"^KERNELS\s*\?=\s*(.*)$", make, re.M).group(1).split()
    assert set(kernels) <= set(tops), set(kernels) - set(tops)
    cfg = open(os.path.join(hls, "smartssd.cfg")).read()
    assert sorted(re.findall(r"^nk=(\w+):1$", cfg, re.M)) == sorted(kernels)
    linked = {}
    for kernel, port in re.findall(r"^sp=(\w+)_1\.(\w+):", cfg, re.M):
        assert kernel in kernels, kernel
        assert port in tops[kernel], f"{kernel} has no port {port}: {tops[kernel]}"
        linked.setdefault(kernel, set()).add(port)
    for kernel in kernels:
        assert linked.get(kernel) == set(tops[kernel]), kernel
