"""Params the caller edits between steps (weight clipping, pruning masks, a rollback through
load_state_dict) become the masters at the next step (smartinf/edits.py), for every master
format, param dtype, tier and overlap: the same params as torch's AdamW given the same
gradients and the same edits."""
import math

import pytest
import torch

import smartinf.optim as so
from smartinf.step import edits
from conftest import assert_close_fp32

SMALL = dict(subgroup_size=700, chunk=256)  # params split across sub-groups and chunks
CLIP = 0.12  # a bf16/fp16 number: clamping to it in the param's dtype is exact


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 9)).to(dtype)


def clamp(model, step, snapshots):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-CLIP, CLIP)  # in place: the param's version counter moves


def prune(model, step, snapshots):
    for i, p in enumerate(model.parameters()):
        torch.manual_seed(i)
        mask = (torch.rand(p.shape) > 0.3).to(p.device, p.dtype)
        p.data.mul_(mask)  # through .data: no version counter sees it


def rollback(model, step, snapshots):
    if step == 1:
        snapshots[id(model)] = {k: v.clone() for k, v in model.state_dict().items()}
    if step == 3:
        model.load_state_dict(snapshots[id(model)])  # a framework restoring a checkpoint


EDITS = {"clamp": clamp, "prune": prune, "rollback": rollback}
FORMATS = {"fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {}),
           "fp16": (torch.float16, {}), "bf16-split": (torch.bfloat16, dict(master="split"))}
TIERS = {"streamed": {}, "resident": dict(memory_budget="1MiB", commit_every=2)}


def train_with_edits(directory, dtype, edit, steps=6, device="cpu", **kw):
    """smartinf.optim.AdamW on a ``dtype`` model on ``device`` (real backward passes) and
    torch's AdamW on an fp32 copy on the CPU given the same gradients, both edited by
    ``edit`` after every step; the params of both after every step, and the speculation's
    counts."""
    ours, theirs = make_model(dtype).to(device), make_model(dtype).float()
    opt = so.AdamW(ours.parameters(), lr=1e-2, devices=[str(directory)], **SMALL, **kw)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    snapshots, history = {}, []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(16, 24, dtype=dtype)
        ours(x.to(device)).float().pow(2).mean().backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            q.grad = p.grad.float().cpu()
        opt.step()
        ref.step()
        opt.zero_grad(set_to_none=True)
        edit(ours, step, snapshots)
        edit(theirs, step, snapshots)
        history.append([(p.detach().cpu().clone(), q.detach().clone())
                        for p, q in zip(ours.parameters(), theirs.parameters())])
    counts = opt._speculation.counts if opt._speculation is not None else None
    opt.close()
    return history, counts


def ulp(x, dtype):
    """One ulp of ``dtype`` at each magnitude of ``x``."""
    big = x.abs().to(dtype)
    return torch.nextafter(big, torch.tensor(math.inf, dtype=dtype)).float() - big.float()


def assert_within_rounding(ours, master, largest, what):
    """fp32: torch's tolerance. bf16/fp16: an edit that equals a master's rounding keeps the
    master (edits.merge), which is then within one ulp of the edit at the element's
    magnitude then; identical later updates keep that difference, and rounding both adds at
    most one ulp now: within two ulps at the largest magnitude the element had
    (``largest``)."""
    if ours.dtype == torch.float32:
        assert_close_fp32(ours.numpy(), master.numpy(), what)
        return
    err = (ours.float() - master.to(ours.dtype).float()).abs()
    bound = 2 * ulp(largest, ours.dtype)
    worst = (err - bound).argmax()
    assert torch.all(err <= bound), \
        f"{what}: {err.flatten()[worst]} off, bound {bound.flatten()[worst]}"


def assert_history_close(history):
    largest = [q.abs() for _, q in history[0]]
    for step, params in enumerate(history):
        for i, (p, q) in enumerate(params):
            largest[i] = torch.maximum(largest[i], q.abs())
            assert_within_rounding(p, q, largest[i], f"param {i} after step {step + 1}")


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("edit", EDITS)
def test_edits_between_steps_become_the_masters(tmp_path, monkeypatch, edit, fmt, tier, overlap):
    if overlap:  # updates start during backward (on the CPU only when asked)
        monkeypatch.setenv("SMARTINF_SPECULATE_ON_CPU", "1")
    dtype, kw = FORMATS[fmt]
    history, counts = train_with_edits(tmp_path, dtype, EDITS[edit], overlap=overlap,
                                       **kw, **TIERS[tier])
    assert_history_close(history)
    if edit == "clamp":  # and the edit itself stuck
        assert all(p.abs().max() <= CLIP for p, _ in history[-1])
    if overlap and fmt != "bf16-split":  # updates started from stale masters were redone
        assert counts.reasons.get("params edited", 0) > 0


def test_an_edit_inside_the_steps_closure_becomes_the_master(tmp_path):
    """step(closure): the params' digests are taken early in the step, but after the closure,
    so an edit the closure makes (after its backward) is taken as the master, as torch's
    optimizer, which reads the params after the closure, takes it."""
    ours, theirs = make_model(), make_model()
    opt = so.AdamW(ours.parameters(), lr=1e-2, devices=[str(tmp_path)], **SMALL)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(4):
        torch.manual_seed(step)
        x = torch.randn(16, 24)
        for model, optimizer in ((ours, opt), (theirs, ref)):
            def closure(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                loss = model(x).pow(2).mean()
                loss.backward()
                prune(model, step, {})  # through .data, after backward
                return loss
            optimizer.step(closure)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert_close_fp32(p.detach().numpy(), q.detach().numpy(), f"step {step + 1}")
    opt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("states", ["gpu", "host"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "bf16-split"])
@pytest.mark.parametrize("edit", EDITS)
def test_edits_of_gpu_params(tmp_path, edit, fmt, states):
    """Params on a GPU (digests there): their states in its memory (the default), updated
    at step() and put by one copy, the digest taken of what was put; or in host memory
    (updates start during backward)."""
    dtype, kw = FORMATS[fmt]
    history, counts = train_with_edits(tmp_path, dtype, EDITS[edit], device="cuda", **kw,
                                       **({} if states == "gpu" else dict(gpu_memory_budget=0)))
    assert_history_close(history)
    if fmt != "bf16-split" and states == "host":
        assert counts.reasons.get("params edited", 0) > 0


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_without_edits_nothing_is_taken(tmp_path, caplog, fmt):
    """No edit: no sub-group written twice, no warning; the params are torch's."""
    dtype, kw = FORMATS[fmt]
    history, _ = train_with_edits(tmp_path, dtype, lambda *a: None, steps=3, **kw)
    assert "changed since the optimizer put them" not in caplog.text
    assert_history_close(history)


def test_state_dict_and_save_hold_the_edits(tmp_path):
    """Edits after the last step are in what state_dict() and save() export."""
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path / "run")], **SMALL)
    model(torch.randn(4, 24)).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    expected = [p.detach().clone() for p in model.parameters()]
    saved = opt.save(str(tmp_path / "ckpt"))
    opt.close()
    fresh = make_model()
    reopened = so.AdamW(fresh.parameters(), lr=1e-2, devices=saved, if_exists="resume", **SMALL)
    for p, q in zip(fresh.parameters(), expected):
        assert torch.equal(p.detach(), q)
    reopened.close()


def test_an_edit_before_close_is_what_a_resume_finds(tmp_path):
    """Pruned after the last step, then closed: reopening the directories (their weights
    replace the model's) gives the pruned params."""
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)], **SMALL)
    model(torch.randn(4, 24)).pow(2).mean().backward()
    opt.step()
    prune(model, 0, {})
    expected = [p.detach().clone() for p in model.parameters()]
    opt.close()
    fresh = make_model()
    so.AdamW(fresh.parameters(), lr=1e-2, devices=[str(tmp_path)], if_exists="resume",
             **SMALL).close()
    for p, q in zip(fresh.parameters(), expected):
        assert torch.equal(p.detach(), q)


def test_bf16_edits_that_equal_the_rounding_keep_the_master():
    """The documented limit: a bf16 param written with its master's rounding is no edit."""
    stored = torch.tensor([1.0 + 2 ** -12, 2.0, -3.0 + 2 ** -10])
    held = stored.to(torch.bfloat16).float()
    held[1] = 0.5  # an edit
    merged = edits.merge(stored, held, torch.bfloat16)
    assert merged.tolist() == [stored[0].item(), 0.5, stored[2].item()]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_digest_sees_every_change_of_bits(device, dtype):
    torch.manual_seed(0)
    whole = torch.randn(1000, dtype=dtype, device=device)
    for start, stop in [(0, 1000), (1, 1000), (3, 517), (5, 6)]:  # any alignment
        part = whole[start:stop]
        base = edits.digest([part])
        assert edits.digest([part.clone()]) == base  # the bits, wherever they are
        for i in {0, part.numel() // 2, part.numel() - 1}:
            flipped = part.clone()
            flipped.view(torch.int16 if dtype != torch.float32 else torch.int32)[i] ^= 1
            assert edits.digest([flipped]) != base, (start, stop, i)
        if part.numel() > 40:
            swapped = part.clone()
            swapped[[2, 37]] = part[[37, 2]]  # moved across rows of 8 words
            assert edits.digest([swapped]) != base
        assert edits.digest([part[:1], part[1:]]) != edits.digest([part[1:], part[:1]]) \
            or part.numel() == 1 or torch.equal(part[:1], part[-1:])


# -- small tensors keep fp32 moments beside int8/int4 states ----------------------------
def biased_pair(directory, state_dtype, **kw):
    """A 256 x 256 weight beside a 7-element bias, smartinf (``state_dtype``) and torch's
    AdamW, 20 steps on the same gradients: (ours, theirs, the model before)."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
    theirs = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
    theirs.load_state_dict(ours.state_dict())
    start = [p.detach().clone() for p in ours.parameters()]
    opt = so.AdamW(ours.parameters(), lr=1e-3, devices=[str(directory)],
                   state_dtype=state_dtype, **kw)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for step in range(20):
        torch.manual_seed(100 + step)
        x = torch.randn(32, 256)
        ours(x).pow(2).mean().backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
    return ours, theirs, start, opt


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_small_tensors_keep_fp32_moments(tmp_path, state_dtype, tier):
    """Tensors of <= defaults.SMALL_TENSOR elements (the biases, the 256 x 7 weight) train
    as with fp32 states, torch's AdamW to its tolerance, where sharing quantisation blocks
    with the 256 x 256 weight had left the 7-element bias 0.72 off its net change (int4);
    that weight keeps quantised moments."""
    ours, theirs, start, opt = biased_pair(tmp_path, state_dtype, **TIERS[tier])
    small = 256 + 256 * 7 + 7  # all but the 256 x 256 weight
    assert [(sg.numel, sg.small) for sg in opt._plan] == [(65536, False), (small, True)]
    stats = opt.pipeline.device_stats
    assert stats[-1]["numel"] == small and stats[0]["numel"] == 65536
    opt.close()
    names = [n for n, _ in ours.named_parameters()]
    for name, p, q, p0 in zip(names, ours.parameters(), theirs.parameters(), start):
        if p.numel() <= 4096:
            assert_close_fp32(p.detach().numpy(), q.detach().numpy(), name)
        else:  # quantised moments: off by their error, not by fp32 rounding
            change = (q - p0).detach().norm()
            assert 1e-4 < float((p - q).detach().norm() / change) < 0.5, name


def test_small_tensor_moments_resume_and_checkpoint(tmp_path):
    """The small tensors' directory is saved, restored and reopened with the others."""
    ours, _, _, opt = biased_pair(tmp_path / "run", "int4")
    saved = opt.save(str(tmp_path / "ckpt"))
    state = opt.state_dict()["state"]
    opt.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
    reopened = so.AdamW(fresh.parameters(), lr=1e-3, devices=saved, state_dtype="int4",
                        if_exists="resume")
    for p, q in zip(fresh.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    again = reopened.state_dict()["state"]
    for i in state:
        for k in state[i]:
            assert torch.equal(torch.as_tensor(state[i][k]), torch.as_tensor(again[i][k])), (i, k)
    reopened.close()


def test_directories_quantising_small_tensors_are_refused_clearly(tmp_path):
    """int4 directories made before small tensors kept fp32 moments (one device, no
    fp32-moments directory) are refused with what to do, not reinterpreted."""
    import smartinf
    with smartinf.Pipeline(str(tmp_path), smartinf.AdamW(), state_dtype="int4") as pipe:
        pipe.add_subgroup(1000)
        with pipe.step():
            pipe.update(0, torch.ones(1000), torch.zeros(1000))
    with pytest.raises(ValueError, match="quantised small tensors' moments too.*if_exists='overwrite'"):
        smartinf.Pipeline(str(tmp_path), smartinf.AdamW(), state_dtype="int4", small_sizes=[7])
    with smartinf.Pipeline(str(tmp_path), smartinf.AdamW(), state_dtype="int4") as pipe:
        with pytest.raises(ValueError, match="small_sizes="):
            pipe.add_subgroup(7, small=True)


def test_the_gpu_digest_counts_words_from_the_first_byte():
    """The words of the GPU's digest (run here on the host's tensors) start at a slice's
    first byte wherever it lies: the same bits at another alignment, the same digest."""
    torch.manual_seed(0)
    whole = torch.randn(1000)
    for start, stop in [(0, 1000), (1, 1000), (3, 517), (5, 6)]:
        part = whole[start:stop].view(torch.uint8)
        assert int(edits._words_digest(part)) == int(edits._words_digest(part.clone()))
        flipped = part.clone()
        flipped[-1] ^= 1
        assert int(edits._words_digest(flipped)) != int(edits._words_digest(part))


def test_the_gpu_digest_is_its_formula():
    """The GPU's digest as its docstring defines it (the words' plain sum taken from their
    rows' sums: wrapping int64, the same value), over words that overflow int64 sums."""
    mix, row = edits._MIX, edits._ROW
    g = torch.Generator().manual_seed(1)
    for nbytes in (8 * 8 * 37 + 21, 8 * 5, 3):
        b = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        words = [int.from_bytes(bytes(b[i:i + 8].tolist()), "little", signed=True)
                 for i in range(0, nbytes - nbytes % 8, 8)]
        rows = len(words) // row
        loose = words[rows * row:] + [int(x) for x in b[8 * len(words):]]
        row_sums = [sum(words[r * row:(r + 1) * row]) for r in range(rows)]
        h = sum(words) * mix + sum((i + 1) * s for i, s in enumerate(row_sums))
        h = h * mix + sum((i + 1) * x for i, x in enumerate(loose)) + nbytes
        wrapped = (h + (1 << 63)) % (1 << 64) - (1 << 63)
        assert int(edits._words_digest(b)) == wrapped


@pytest.mark.parametrize("device", DEVICES)
def test_the_matmul_digest_sees_every_change_of_bits(device):
    """The GPU's digest of many 4 KiB rows (run here on the host's tensors too): the same bits
    at any alignment give the same digest; a flipped bit anywhere (the rows, the last partial
    row), or a word moved within its row or across rows, another."""
    weights = edits.mm_weights(torch.device(device))
    if weights is None:
        pytest.skip("torch._int_mm does not run here")
    torch.manual_seed(0)
    whole = torch.randn(300_000, device=device)
    for start, stop in [(0, 300_000), (1, 300_000), (3, 250_017), (7, 100_000)]:
        part = whole[start:stop].view(torch.uint8)
        base = int(edits._matmul_digest(part, weights))
        assert int(edits._matmul_digest(part.clone(), weights)) == base
        rows = part.numel() // edits.MM_ROW
        last = part.numel() - 1
        for i in {0, 8, edits.MM_ROW * 3 + 5, part.numel() // 2, rows * edits.MM_ROW, last}:
            flipped = part.clone()
            flipped[i] ^= 1
            assert int(edits._matmul_digest(flipped, weights)) != base, (start, i)
        words = part.clone()[:rows * edits.MM_ROW].view(torch.int64)
        for a, b in [(0, 1), (3, 400), (10, 40_000)]:  # in a row, across rows
            moved = part.clone()
            moved[:rows * edits.MM_ROW].view(torch.int64)[[a, b]] = words[[b, a]]
            assert int(edits._matmul_digest(moved, weights)) != base, (a, b)
    if device == "cuda":  # (the slices' bytes one after another: optim records ``flat``'s)
        assert edits.digest([whole[:1000], whole[1000:]]) == edits.digest([whole.clone()])
        assert edits.digest([whole[1000:], whole[:1000]]) != edits.digest([whole])


def test_each_8_byte_block_of_the_matmul_digests_weights_is_nonsingular():
    """A changed word changes its row's sums: each word's 8 x 8 block of the weights has a
    nonzero determinant (exact: fraction-free elimination over Python's integers)."""
    weights = edits.mm_weights(torch.device("cpu"))
    assert weights.shape == (edits.MM_ROW, 8) and bool((weights != 0).all())

    def determinant(m: list) -> int:  # Bareiss
        m, sign, prev = [row[:] for row in m], 1, 1
        for k in range(len(m) - 1):
            if m[k][k] == 0:
                swap = next((i for i in range(k + 1, len(m)) if m[i][k]), None)
                if swap is None:
                    return 0
                m[k], m[swap], sign = m[swap], m[k], -sign
            for i in range(k + 1, len(m)):
                for j in range(k + 1, len(m)):
                    m[i][j] = (m[i][j] * m[k][k] - m[i][k] * m[k][j]) // prev
            prev = m[k][k]
        return sign * m[-1][-1]
    rows = weights.tolist()
    for word in range(edits.MM_ROW // 8):
        assert determinant(rows[8 * word:8 * word + 8]) != 0, word


def test_the_matmul_digest_is_its_formula():
    """The GPU's digest as its docstring defines it, computed here another way (int64 matmul,
    Python's integers wrapped at the end), with and without a last partial row."""
    weights = edits.mm_weights(torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    for n in (edits.MM_ROW * 20 + 100, edits.MM_ROW * 17):
        b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        rows = n // edits.MM_ROW
        block = b[:rows * edits.MM_ROW].view(torch.int8).view(rows, -1).to(torch.int64)
        sums = (block @ weights.to(torch.int64)).view(-1).tolist()
        mixed = edits._mixed(torch.arange(1, len(sums) + 1, dtype=torch.int64)).tolist()
        h = (sum(sums) * edits._MIX + sum(s * m for s, m in zip(sums, mixed))) * edits._MIX + n
        if n % edits.MM_ROW:
            h = h * edits._MIX + int(edits._words_digest(b[rows * edits.MM_ROW:]))
        assert int(edits._matmul_digest(b, weights)) == (h + (1 << 63)) % (1 << 64) - (1 << 63)


@pytest.mark.parametrize("device", DEVICES)
def test_small_gpu_tensors_are_digested_together_as_alone(device):
    """The GPU's digest of many small tensors at once (DeepSpeed's kept-whole params, run
    here on the host's tensors too): a tensor's digest is its own whatever else is in the
    call; every changed bit, two bytes swapped, and changes that cancel in a plain or a
    position-weighted sum ((+1, -2, +1) on bytes 1-3) each change it."""
    torch.manual_seed(0)
    whole = torch.randn(1000, device=device).view(torch.uint8)
    runs = [whole[3:517], whole[0:1], whole[1000:1000], whole[5:4001]]

    def alone(b):
        return int(edits._small_digests(b.clone(), [b.numel()])[0])
    together = edits._small_digests(torch.cat(runs), [b.numel() for b in runs]).tolist()
    assert together == [alone(b) for b in runs]
    part = runs[3]
    base = alone(part)
    for i in {0, part.numel() // 2, part.numel() - 1}:
        for bit in (0, 7):
            flipped = part.clone()
            flipped[i] ^= 1 << bit
            assert alone(flipped) != base, (i, bit)
    swapped = part.clone()
    swapped[[2, 37]] = part[[37, 2]]
    assert torch.equal(swapped, part) or alone(swapped) != base
    cancel = torch.full((8,), 100, dtype=torch.uint8, device=device)
    edited = cancel.clone()
    edited[1:4] += torch.tensor([1, -2 % 256, 1], dtype=torch.uint8, device=device)
    assert alone(edited) != alone(cancel)
    assert alone(part[:-1]) != alone(torch.cat([part[:-1], part[:1] * 0]))  # the length counts


@pytest.mark.parametrize("device", DEVICES)
def test_run_sums_are_index_adds_wrapping(device):
    """The small tensors' digest sums each run by differences of one prefix sum: the same
    int64 values, wrapping, as index_add_ by run (what it replaced), for runs empty, of one
    element and long, of values whose sums wrap."""
    g = torch.Generator().manual_seed(3)
    sizes = [5, 0, 1, 4000, 0, 77, 1]
    x = torch.randint(-2**62, 2**62, (sum(sizes),), generator=g, dtype=torch.int64).to(device) * 3
    lengths = torch.tensor(sizes, device=device)
    ends = lengths.cumsum(0)
    key = torch.repeat_interleave(torch.arange(len(sizes), device=device), lengths)
    expected = torch.zeros(len(sizes), dtype=torch.int64, device=device).index_add_(0, key, x)
    got = edits._run_sums(x, ends - lengths, ends)
    assert got.tolist() == expected.tolist()
    assert got[1] == 0 and got[2] == x[5]


NATIVE_GPU = torch.cuda.is_available() and edits._build_info.CUDA


def unit_digest_reference(parts):
    """native_digests' formula on the host, in Python's integers: the 2-byte units of the
    parts one after another, their sum and their sum weighted by the kernel's hash of each
    position (device/cuda_digest.cu), and the length in bytes, folded modulo 2**64 as int64."""
    b = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for t in parts])
    units = (b.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    m32, m64 = (1 << 32) - 1, (1 << 64) - 1
    plain = mixed = 0
    for position, u in enumerate(units):
        x = (position * 0x9E3779B1) & m32
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m32
        x ^= x >> 13
        plain, mixed = plain + u, mixed + u * x
    mix = edits._MIX % (1 << 64)
    h = (((plain * mix + mixed) & m64) * mix + b.numel()) & m64
    return h - (1 << 64) if h >> 63 else h


@pytest.mark.skipif(not NATIVE_GPU, reason="needs a CUDA GPU and smartinf built with CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_gpu_digest_is_its_formula_however_the_bytes_are_cut(dtype):
    """One launch for many keys (device/cuda_digest.cu): each key's digest is the formula of
    its bytes (Python's integers), whatever else is in the call; parts at odd 2-byte offsets,
    empty ones, and keys across the kernel's chunks give the digest of their concatenation."""
    torch.manual_seed(0)
    chunk = edits._native.digest_chunk_units()
    whole = torch.randn(3 * chunk + 1001, dtype=dtype, device="cuda")
    keys = [[whole[1:2000]], [whole[3:517], whole[517:517], whole[517:4001]], [whole[:1]],
            [whole[5:2 * chunk + 7], whole[2 * chunk + 7:]], [whole[4:4]]]
    got = [int(d) for d in edits.native_digests(torch.device("cuda"), keys)]
    assert got[:3] == [unit_digest_reference(parts) for parts in keys[:3]]
    assert got[4] == 0  # (no bytes)
    alone = [int(edits.native_digests(torch.device("cuda"), [parts])[0]) for parts in keys]
    assert got == alone
    assert got[3] == int(edits.digest([whole[5:].clone()]))  # cut anywhere: one stream
    assert edits.digests([[whole[:10], whole[10:]]])[0] == edits.digest([whole])  # (digests' way)


@pytest.mark.skipif(not NATIVE_GPU, reason="needs a CUDA GPU and smartinf built with CUDA")
def test_the_native_gpu_digest_sees_every_change_of_bits():
    """Any flipped bit (in every chunk), two units swapped far apart or within a chunk, and two
    changes that cancel in the plain sum, each change the digest; the same bits elsewhere keep it."""
    torch.manual_seed(1)
    chunk = edits._native.digest_chunk_units()
    part = torch.randn(chunk + 999, device="cuda")[3:]
    base = int(edits.digest([part]))
    assert int(edits.digest([part.clone()])) == base
    units = part.view(torch.int16)
    for i in {0, 1, chunk - 1, chunk, 2 * chunk + 5, units.numel() - 1}:
        for bit in (0, 15):
            flipped = part.clone()
            flipped.view(torch.int16)[i] ^= 1 << bit if bit < 15 else -(1 << 15)
            assert int(edits.digest([flipped])) != base, (i, bit)
    for a, b in [(0, 1), (7, 2 * chunk + 3)]:
        swapped = part.clone()
        swapped.view(torch.int16)[[a, b]] = units[[b, a]]
        assert torch.equal(swapped, part) or int(edits.digest([swapped])) != base, (a, b)
    cancel = part.clone()
    cancel.view(torch.int16)[[10, 20]] += torch.tensor([1, -1], dtype=torch.int16, device="cuda")
    assert int(edits.digest([cancel])) != base
