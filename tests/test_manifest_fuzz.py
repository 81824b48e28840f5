"""The manifest parser against 12 000 generated inputs (hypothesis, derandomized so CI
runs the same ones): well-formed manifests round-trip exactly; mutated ones (with a
valid checksum, so the parser proper is reached) and raw bytes are either refused with a
ValueError or parsed into a manifest that round-trips; nothing crashes or hangs."""
import zlib

from hypothesis import HealthCheck, given, settings, strategies as st

import smartinf._native as native

def fuzz(examples):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

CURRENT = 10  # the version the core writes
u64 = st.integers(0, 2**64 - 1)
word = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=12)


def with_crc(body: bytes) -> bytes:
    return body + b"crc32 %08x\n" % zlib.crc32(body)


@st.composite
def manifests(draw):
    """A well-formed manifest, written the way the core writes one."""
    chunk = draw(st.integers(1, 5000))
    version = draw(st.sampled_from([2, 3, 4, 5, 6, 7, 8, 9, 10]))
    lines = [f"smartinf-manifest {version}", f"chunk {chunk}",
             f"state_dtype {draw(st.sampled_from(['fp32', 'int8', 'int4']))}"]
    if version >= 7:
        lines.append(f"master {draw(st.sampled_from(['fp32', 'split']))}")
    lines += [f"optimizer {draw(st.sampled_from(['adam', 'adamw', 'sgd', 'adagrad']))}"]
    hyper = draw(st.dictionaries(word, st.floats(allow_nan=False, allow_infinity=False), max_size=4))
    lines += [f"hyper {k} {v:.17g}" for k, v in sorted(hyper.items(), key=lambda kv: kv[0].encode())]
    step = draw(u64)
    lines.append(f"step {step}")
    if version >= 6:
        lines.append(f"previous {draw(st.integers(0, step))}")
    if version >= 5 and draw(st.booleans()):
        lines.append(f"attached {draw(st.integers(0, 2**63 - 1))}")
    log = False
    if version >= 9:
        copies = draw(st.sampled_from([1, 2]))
        lines.append(f"copies {copies}")
        if copies == 1 and draw(st.booleans()):
            lines.append("rewriting")
        log = version >= 10 and copies == 1 and draw(st.booleans())
        if log:  # forward recovery: the spares, and each chunk's extent (below)
            lines += ["log", f"spares {draw(st.integers(0, 2**59))} {draw(st.integers(1, 64))}"]
    count = draw(st.integers(1, 8))
    if draw(st.booleans()):
        index = draw(st.integers(0, count - 1))
        lines.append(f"member {draw(word)} {index} {count}")
    ids = draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=count, max_size=count, unique=True))
    records = []
    for i in ids:
        numel = draw(st.integers(1, 20 * chunk))
        records.append((i, numel))
        lines.append(f"sg {i} {numel} {draw(st.integers(0, 2**59))} {draw(st.integers(0, 1))} "
                     f"{draw(u64)} {draw(u64)} {draw(u64)}")
    lines.insert(-count, f"subgroups {count}")
    if log:
        for i, numel in records:
            chunks = -(-numel // chunk)
            lines.append(f"at {i} " + " ".join(f"{x:016x}" for x in draw(
                st.lists(st.integers(0, 2**59), min_size=chunks, max_size=chunks))))
    if version >= 5:
        for i, _ in records:
            if draw(st.booleans()):
                lines.append(f"fingerprint {i} {draw(st.integers(1, 2**64 - 1)):016x}")
    for i, numel in records:
        for copy in (0, 1):
            if draw(st.booleans()):
                sums = draw(st.lists(u64, min_size=-(-numel // chunk), max_size=-(-numel // chunk)))
                if any(sums):
                    lines.append(f"sums {i} {copy} " + " ".join(f"{x:016x}" for x in sums))
    return with_crc("".join(line + "\n" for line in lines).encode())


@fuzz(2000)
@given(manifests())
def test_well_formed_manifests_round_trip(text):
    version = int(text.split(b"\n", 1)[0].split()[1])
    got = native.manifest_roundtrip(text)
    body = text[:text.rindex(b"crc32 ")]
    current = f"smartinf-manifest {CURRENT}".encode()
    if version < 6:  # before version 6 every step was committed: the previous one is step - 1
        step = int(body.split(b"\nstep ")[1].split(b"\n")[0])
        body = body.replace(b"\nstep %d\n" % step, b"\nstep %d\nprevious %d\n" % (step, max(step - 1, 0)), 1)
    if version < 7:  # before version 7 masters were fp32
        dtype = body.split(b"\nstate_dtype ")[1].split(b"\n")[0]
        body = body.replace(b"\nstate_dtype %s\n" % dtype, b"\nstate_dtype %s\nmaster fp32\n" % dtype, 1)
    if version < 9:  # before version 9 every directory held two copies
        at = min(i for i in (body.find(b"\nmember "), body.find(b"\nsubgroups ")) if i >= 0)
        body = body[:at] + b"\ncopies 2" + body[at:]
    assert got == with_crc(body.replace(f"smartinf-manifest {version}".encode(), current, 1)) \
        or version < 4  # older versions are rewritten as the current one
    assert native.manifest_roundtrip(got) == got


def parse_or_refuse(text):
    try:
        out = native.manifest_roundtrip(text)
    except ValueError as e:
        assert "manifest" in str(e)
        return
    assert native.manifest_roundtrip(out) == out


@fuzz(8000)
@given(manifests(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 16), st.binary(max_size=16)),
                             min_size=1, max_size=4))
def test_mutated_manifests_are_refused_or_parsed(text, edits):
    body = bytearray(text[:text.rindex(b"crc32 ")])
    for at, cut, insert in edits:  # replace `cut` bytes at `at` with `insert`
        at %= len(body) + 1
        body[at:at + cut] = insert
    parse_or_refuse(with_crc(bytes(body)))


@fuzz(2000)
@given(st.binary(max_size=400))
def test_random_bytes_are_refused(text):
    parse_or_refuse(text)
    parse_or_refuse(with_crc(text))
