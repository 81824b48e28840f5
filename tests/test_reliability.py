"""What the stored states survive: failed commits, I/O errors and short I/O, a full disk,
bit rot, a second writer, and hostile directories. Faults come from the core's test-only
fault points (``smartinf._native.arm_fault``); the disk is full for real (a loop-mounted
ext4 image)."""
import errno
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import smartinf
import smartinf._native as native
from smartinf.pipeline.checkpoint import manifest_fields
from conftest import ENGINES, fill, open_with_subgroups

SIZES = [3000, 2500, 1000]
CHUNK = 1000
RULE = smartinf.AdamW(lr=1e-2, weight_decay=0.1)


@pytest.fixture(autouse=True)
def no_fault_left_armed():
    yield
    native.disarm_fault()


def open_pipe(dirs, **kwargs):
    return open_with_subgroups(dirs, RULE, SIZES, CHUNK, **kwargs)


def grads(step):
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


def run_step(pipe, step):
    outs = [np.empty(n, np.float32) for n in SIZES]
    with pipe.step():
        futures = [pipe.update(i, g, o) for i, (g, o) in enumerate(zip(grads(step), outs))]
        for f in futures:
            f.wait()
    return outs


def states(pipe):
    return [pipe.read_states(i) for i in range(len(SIZES))]


def assert_states_equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        for k in x:
            assert np.array_equal(x[k], y[k]), f"{k} of sub-group {i} differs"


@pytest.fixture
def reference(tmp_path_factory):
    """States after 0, 1, 2 and 3 fault-free steps."""
    with open_pipe(str(tmp_path_factory.mktemp("ref"))) as pipe:
        result = [states(pipe)]
        for step in range(3):
            run_step(pipe, step)
            result.append(states(pipe))
    return result


# -- a second writer ---------------------------------------------------------------------
def test_one_directory_one_writer(disk_dir):
    with open_pipe(disk_dir):
        with pytest.raises(OSError, match=f"open in another pipeline \\(process {os.getpid()}\\)") as e:
            smartinf.Pipeline(disk_dir, RULE, chunk=CHUNK)
        assert e.value.errno == errno.EBUSY
        holder = textwrap.dedent(f"""
            import smartinf
            try:
                smartinf.Pipeline({disk_dir!r}, chunk={CHUNK})
            except OSError as e:
                print(e.errno, e)
        """)
        out = subprocess.run([sys.executable, "-c", holder], capture_output=True, text=True,
                             timeout=120).stdout
        assert out.startswith(f"{errno.EBUSY} ") and "another pipeline" in out
    with open_pipe(disk_dir) as pipe:  # closed: free again
        assert pipe.resumed(0)


def test_a_lock_whose_holder_has_exited_is_waited_for(disk_dir):
    """A killed process's lock outlives it while the kernel finishes its in-flight I/O: an
    open that finds the recorded holder gone waits for the lock instead of refusing (here
    another process holds it a moment under a dead holder's pid)."""
    with open_pipe(disk_dir):
        pass
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    holder = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({os.path.join(disk_dir, "lock")!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0); os.pwrite(fd, b"{dead}", 0)
        print("held", flush=True)
        time.sleep(1.0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with open_pipe(disk_dir) as pipe:  # EBUSY without the wait
            assert pipe.resumed(0)
        assert proc.wait(timeout=60) == 0  # it let go first
    finally:
        proc.kill()


# -- failed commits ----------------------------------------------------------------------
@pytest.mark.parametrize("point", ["store.synced", "manifest.written", "manifest.renamed"])
def test_failed_commit_changes_nothing(tmp_path, reference, point):
    d = str(tmp_path / "dev")
    with open_pipe(d) as pipe:
        run_step(pipe, 0)
        native.arm_fault(point, "error", errno=errno.EIO)
        with pytest.raises(OSError, match=f"injected fault at {point}") as e:
            run_step(pipe, 1)
        assert e.value.errno == errno.EIO
        # the step stands, nothing undone; the directory holds step 1 until a commit lands
        assert (pipe.step_count, pipe.durable_step_count) == (2, 1)
        assert_states_equal(states(pipe), reference[2])
        assert not os.path.exists(os.path.join(d, "manifest.tmp"))
        assert manifest_step(d) == 1
        pipe.flush()  # the commit again
        assert pipe.durable_step_count == 2 and manifest_step(d) == 2
    with open_pipe(d) as pipe:
        assert pipe.step_count == 2
        assert_states_equal(states(pipe), reference[2])


def manifest_step(directory):
    return int(manifest_fields(directory)["step"])


def the_step_stands_then_commits(pipe, dirs, reference_two):
    """After a failed commit of the second step: every directory at step 1, the step
    standing in memory bit for bit, made durable by the next commit; reopened at 2."""
    assert (pipe.step_count, pipe.durable_step_count) == (2, 1)
    assert [manifest_step(d) for d in dirs] == [1, 1]
    assert_states_equal(states(pipe), reference_two[2])
    pipe.close()
    with open_pipe(dirs) as pipe:
        assert pipe.step_count == 2
        assert_states_equal(states(pipe), reference_two[2])


def test_failed_commit_on_the_second_device_rolls_back_the_first(tmp_path, reference_two):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    with open_pipe(dirs) as pipe:
        run_step(pipe, 0)
        native.arm_fault("pipeline.device_committed", "error")  # after device a
        with pytest.raises(OSError, match="injected fault"):
            run_step(pipe, 1)
        the_step_stands_then_commits(pipe, dirs, reference_two)


def test_a_failed_sync_on_the_second_device_publishes_no_device(tmp_path, reference_two):
    # Every device syncs before any publishes: the first device's manifest is never
    # written at the new step, so there is nothing to roll back (a rollback rewrites it).
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    manifests = [os.path.join(d, "manifest") for d in dirs]
    with open_pipe(dirs) as pipe:
        run_step(pipe, 0)
        before = [open(m, "rb").read() for m in manifests]
        native.arm_fault("store.synced", "error", after=1, errno=errno.ENOSPC)  # device b's
        with pytest.raises(OSError, match="injected fault at store.synced"):
            run_step(pipe, 1)
        assert [open(m, "rb").read() for m in manifests] == before
        the_step_stands_then_commits(pipe, dirs, reference_two)


@pytest.fixture
def reference_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref2")
    with open_pipe([str(root / "a"), str(root / "b")]) as pipe:
        result = [states(pipe)]
        for step in range(2):
            run_step(pipe, step)
            result.append(states(pipe))
    return result


# -- I/O errors and short I/O ------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("point", ["io.read", "io.write"])
def test_io_error_fails_the_step_and_keeps_the_last_one(disk_dir, reference, engine, point):
    with open_pipe(disk_dir, io=engine) as pipe:
        run_step(pipe, 0)
        native.arm_fault(point, "error", after=3, errno=errno.EIO)
        with pytest.raises(OSError, match="(read|write) failed") as e:
            run_step(pipe, 1)
        assert e.value.errno == errno.EIO and e.value.filename.endswith("states.bin")
        assert pipe.step_count == 1
        assert_states_equal(states(pipe), reference[1])
        run_step(pipe, 1)
        run_step(pipe, 2)
        assert_states_equal(states(pipe), reference[3])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("point", ["io.read", "io.write"])
def test_short_io_is_completed(disk_dir, reference, engine, point):
    with open_pipe(disk_dir, io=engine) as pipe:
        for step in range(3):
            native.arm_fault(point, "short", after=step)
            run_step(pipe, step)
        assert_states_equal(states(pipe), reference[3])


# -- bit rot -----------------------------------------------------------------------------
def extent_of(directory, sg, chunk):
    """(offset, bytes) of the committed copy of `chunk` of sub-group `sg`, from the manifest."""
    for line in open(os.path.join(directory, "manifest")):
        word = line.split()
        if word[0] == "sg" and int(word[1]) == sg:
            numel, offset, copy = int(word[2]), int(word[3]), int(word[4])
            full = -(-CHUNK * 12 // 4096) * 4096
            n = min(CHUNK, numel - chunk * CHUNK)
            size = -(-n * 12 // 4096) * 4096
            return offset + 2 * chunk * full + copy * size, size
    raise AssertionError(f"sub-group {sg} not in the manifest")


def flip_bit(directory, sg, chunk, at=100):
    offset, _ = extent_of(directory, sg, chunk)
    with open(os.path.join(directory, "states.bin"), "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_is_found_when_reopened(disk_dir):
    with open_pipe(disk_dir) as pipe:
        for step in range(2):
            run_step(pipe, step)
    flip_bit(disk_dir, sg=1, chunk=2)
    with pytest.raises(OSError, match="checksum mismatch in sub-group 1, chunk 2 .*written at step 2") as e:
        open_pipe(disk_dir)
    assert e.value.errno == errno.EBADMSG
    flip_bit(disk_dir, sg=1, chunk=2)  # flipped back: whole again
    with open_pipe(disk_dir) as pipe:
        assert pipe.step_count == 2


def test_verify_checks_every_load(disk_dir, reference):
    with open_pipe(disk_dir, verify=True) as pipe:
        run_step(pipe, 0)
        flip_bit(disk_dir, sg=0, chunk=1, at=5000)
        with pytest.raises(OSError, match="checksum mismatch in sub-group 0, chunk 1"):
            run_step(pipe, 1)
        assert pipe.step_count == 1
    # Without verify the same load goes unchecked (the flip is in the master weights).
    flip_bit(disk_dir, sg=0, chunk=1, at=5000)
    with open_pipe(disk_dir) as pipe:
        assert_states_equal(states(pipe), reference[1])


def test_checksums_survive_reopen_and_cover_every_extent(disk_dir):
    with open_pipe(disk_dir) as pipe:
        run_step(pipe, 0)
    text = open(os.path.join(disk_dir, "manifest")).read()
    sums = [line.split() for line in text.splitlines() if line.startswith("sums ")]
    # Both copies of every sub-group: the initial states (copy 0) and step 1's (copy 1).
    assert sorted((int(s[1]), int(s[2])) for s in sums) == [(sg, c) for sg in range(3) for c in (0, 1)]
    for s in sums:
        assert len(s) - 3 == -(-SIZES[int(s[1])] // CHUNK) and "0" * 16 not in s


# -- a full disk -------------------------------------------------------------------------
def test_full_disk_when_adding_a_subgroup(small_fs):
    with smartinf.Pipeline(small_fs, RULE, chunk=CHUNK) as pipe:
        pipe.add_subgroup(1000)
        with pytest.raises(OSError, match="cannot allocate") as e:
            pipe.add_subgroup(2_000_000)  # 48 MB of states on a 24 MiB disk
        assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("states.bin")
        assert pipe.num_subgroups == 1
        with pipe.step():
            pipe.update(0, np.ones(1000, np.float32), np.empty(1000, np.float32))
        assert pipe.step_count == 1


def test_full_disk_at_commit_keeps_the_last_step(small_fs, reference):
    with open_pipe(small_fs) as pipe:
        run_step(pipe, 0)
        filler = fill(small_fs)
        with pytest.raises(OSError) as e:
            run_step(pipe, 1)
        assert e.value.errno == errno.ENOSPC and small_fs in e.value.filename
        assert (pipe.step_count, pipe.durable_step_count) == (2, 1)  # the step stands
        assert_states_equal(states(pipe), reference[2])
        os.remove(filler)
        pipe.flush()
        assert pipe.durable_step_count == 2
    with open_pipe(small_fs) as pipe:
        assert_states_equal(states(pipe), reference[2])


# -- hostile directories -----------------------------------------------------------------
def rewrite_manifest(directory, edit):
    path = os.path.join(directory, "manifest")
    with open(path, "rb") as f:
        text = f.read()
    with open(path, "wb") as f:
        f.write(edit(text))


def with_crc(body: bytes) -> bytes:
    import zlib
    return body + b"crc32 %08x\n" % zlib.crc32(body)


def body_of(text: bytes) -> bytes:
    return text[:text.rindex(b"crc32 ")]


@pytest.mark.parametrize("edit, match", [
    (lambda t: t[: len(t) // 2], "no checksum line|malformed checksum"),
    (lambda t: b"\x00\xff garbage" * 10, "no checksum line|malformed checksum"),
    (lambda t: t.replace(b"step 1", b"step 2"), "checksum mismatch"),
    (lambda t: with_crc(body_of(t).replace(b"smartinf-manifest 10", b"smartinf-manifest 1")),
     "format version 1, this smartinf reads 2 to 10"),
    (lambda t: with_crc(body_of(t).replace(b"smartinf-manifest 10", b"smartinf-manifest 11")),
     "format version 11"),
    (lambda t: with_crc(body_of(t) + b"bogus 1\n"), "unknown record 'bogus'"),
    (lambda t: with_crc(body_of(t).replace(b"subgroups 3", b"subgroups 4")), "count mismatch"),
])
def test_bad_manifest_is_refused_and_left_alone(disk_dir, edit, match):
    with open_pipe(disk_dir) as pipe:
        run_step(pipe, 0)
    good = open(os.path.join(disk_dir, "manifest"), "rb").read()
    rewrite_manifest(disk_dir, edit)
    bad = open(os.path.join(disk_dir, "manifest"), "rb").read()
    with pytest.raises(ValueError, match=f"corrupt or foreign manifest .*({match})"):
        smartinf.Pipeline(disk_dir, RULE, chunk=CHUNK)
    assert open(os.path.join(disk_dir, "manifest"), "rb").read() == bad  # nothing rewritten
    rewrite_manifest(disk_dir, lambda _: good)  # repaired: it opens (the refusal left no lock)
    with open_pipe(disk_dir) as pipe:
        assert pipe.step_count == 1


def test_truncated_states_file_is_refused(disk_dir):
    with open_pipe(disk_dir) as pipe:
        run_step(pipe, 0)
    os.truncate(os.path.join(disk_dir, "states.bin"), 4096)
    with pytest.raises(ValueError, match="has 4096 bytes but its manifest needs .*truncated"):
        smartinf.Pipeline(disk_dir, RULE, chunk=CHUNK)


@pytest.mark.parametrize("call, error, match", [
    (lambda p: p.add_subgroup(0), ValueError, "numel must be positive"),
    (lambda p: p.add_subgroup(1 << 50), ValueError, "more than 4194304 chunks; use a larger chunk"),
    (lambda p: p.update(0, np.ones(3000, np.float32), np.empty(3000, np.float32),
                        lr=float("nan")), ValueError, "lr=nan"),
    (lambda p: p.update(0, np.ones(3000, np.float32), np.empty(3000, np.float32),
                        grad_scale=float("inf")), ValueError, "grad_scale"),
])
def test_hostile_calls(disk_dir, call, error, match):
    with open_pipe(disk_dir) as pipe:
        with pytest.raises(error, match=match):
            call(pipe)
        run_step(pipe, 0)  # still usable
        assert pipe.step_count == 1


def test_arming_an_unknown_fault_point_is_refused():
    with pytest.raises(ValueError, match="unknown fault point 'io.nothing'"):
        native.arm_fault("io.nothing", "error")
    with pytest.raises(ValueError, match="action must be one of"):
        native.arm_fault("io.read", "explode")


# -- directories that are not what they seem -------------------------------------------
def test_states_without_a_manifest_are_refused_not_reinitialised(disk_dir):
    """A lost manifest (or an interrupted copy into the directory) leaves states that
    cannot be read: refused, never taken for a fresh directory."""
    with open_pipe(disk_dir) as pipe:
        run_step(pipe, 0)
    os.remove(os.path.join(disk_dir, "manifest"))
    with open(os.path.join(disk_dir, "states.bin"), "rb") as f:
        before = f.read()
    with pytest.raises(ValueError, match="holds states .* but no manifest"):
        smartinf.Pipeline(disk_dir, RULE, chunk=CHUNK)
    with open(os.path.join(disk_dir, "states.bin"), "rb") as f:
        assert f.read() == before


def create_and_die(dirs, point, after, delay):
    """Forks a child that creates a pipeline on ``dirs`` and is killed by a fault point
    (or after ``delay`` seconds); returns once it is dead."""
    pid = os.fork()
    if pid == 0:
        if point:
            native.arm_fault(point, "kill", after=after)
        else:
            signal.setitimer(signal.ITIMER_REAL, delay)
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        try:
            open_pipe(dirs).close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("point, after", [("manifest.written", 0), ("manifest.renamed", 0),
                                          ("manifest.written", 1), ("manifest.renamed", 1),
                                          (None, 0)])
def test_a_creation_killed_between_directories_is_finished_on_reopen(tmp_path, reference_two, point, after):
    """Killed while the two directories get their first manifests, one after the other:
    reopening finishes the set (random moments too, for the default case)."""
    rng = np.random.default_rng(0)
    for trial in range(1 if point else 20):
        dirs = [str(tmp_path / f"{trial}" / d) for d in ("d0", "d1")]
        for d in dirs:
            os.makedirs(d)
        create_and_die(dirs, point, after, float(rng.uniform(0.0005, 0.03)))
        with open_pipe(dirs) as pipe:
            for step in range(2):
                run_step(pipe, step)
            assert_states_equal(states(pipe), reference_two[2])
