"""Issue 88's GPU acceptance lines, checked and reported (a JSON record to ``--out``):

1. fsdp_reset: the README's loop over FSDP2 (world 1, ``fully_shard`` per block and the root)
   with both moments reset through ``opt.state`` after step ``--steps // 2``:
   ``smartinf.optim.AdamW`` (defaults: updates during backward on a GPU) against torch's
   AdamW (fused on a GPU, foreach on the CPU), losses side by side. Noise floor: torch fused
   against torch foreach, measured here; passes where smartinf's largest relative loss gap is
   at most max(4 x floor, 1e-3 with bf16 compute on a GPU / 1e-5 in fp32 on the CPU), and where
   the reset moves both smartinf's and torch's losses by at least 5 times that tolerance (the
   same runs without it: the check can tell a reset ignored).
2. ddp_resume: DDP world 2 (2 GPUs: nccl, one each; 1 GPU: gloo, both on cuda:0; CPU:
   gloo), ``commit_every=2``; rank 1's directory put back one durable commit behind must reopen
   with every rank at the lower step, identical replicas (and the uninterrupted run's params)
   2 steps later; two commits apart, and rank 1's directory missing, must raise on every rank
   and leave the directories' bytes as they were.

    python3 bench/gpu_state_checks.py --out /tmp/out/state_checks.json          # a GPU box
    python3 bench/gpu_state_checks.py --device cpu --out /tmp/c.json             # a dry run
    (on the CPU it sets SMARTINF_SPECULATE_ON_CPU=1 and SMARTINF_STEP_TAIL_ON_CPU=1: the GPU's paths)

Exit code 0 only when every check passed.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
ARGS.add_argument("--out", required=True)
ARGS.add_argument("--steps", type=int, default=10)
ARGS.add_argument("--root", default=None, help="temp dirs go under it (default: a new tempdir)")
ARGS.add_argument("--timeout", type=float, default=300.0, help="seconds per DDP launch")
if __name__ == "__main__" and ARGS.parse_known_args()[0].device == "cpu":
    # On the CPU, take the GPU's default paths (updates during backward, the step's tail),
    # before smartinf reads its environment; the DDP ranks inherit it.
    os.environ.setdefault("SMARTINF_SPECULATE_ON_CPU", "1")
    os.environ.setdefault("SMARTINF_STEP_TAIL_ON_CPU", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

import smartinf.optim as so  # noqa: E402
from smartinf.pipeline.checkpoint import manifest_fields  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel(a: float, b: float) -> float:  # (relative to b)
    return abs(a - b) / max(abs(b), 1e-12)


def param_gap(a: list, b: list) -> float:
    """max over params of |a - b|_inf / |b|_inf (elementwise ratios blow up near zero)."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


# -- 1. FSDP2 world 1, moments reset through opt.state --------------------------------------
LR = 3e-3  # (1e-3 moved the losses by 0.6 % at the reset on the CPU's model, 3e-3 by 2 %)


def fsdp_run(kind: str, reset: bool, a, directory: str) -> dict:
    """One training run of ``kind`` (smartinf, torch-fused, torch-foreach): its losses, final
    params (fp32, on the host), and smartinf's counts of updates during backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    cuda = a.device == "cuda"
    vocab, seq, d, layers, heads, batch = (512, 64, 256, 4, 4, 8) if cuda else (128, 32, 64, 2, 4, 4)
    with torch.device(a.device):
        model = GPT(GPTConfig(vocab, seq, d, layers, heads), seed=0)
    # bf16 compute over fp32 sharded params on a GPU (bench/gpu_fsdp_step.py's policy); fp32 on the CPU
    policy = MixedPrecisionPolicy(torch.bfloat16 if cuda else None, torch.float32 if cuda else None)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if kind == "smartinf":
        opt = so.AdamW(model.parameters(), lr=LR, devices=[directory])
    else:  # torch-fused, torch-foreach
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **{kind[6:]: True})
    losses = []
    for step in range(1, a.steps + 1):
        # a learnable sequence (x[t+1] = 3 x[t] + 1 mod vocab) from a random start, by step number
        cols = [torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(step))]
        for _ in range(seq - 1):
            cols.append((3 * cols[-1] + 1) % vocab)
        x = torch.stack(cols, 1).to(a.device)
        logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if reset and step == a.steps // 2:
            for p in model.parameters():  # as a user writes it
                s = opt.state[p]
                s["exp_avg"].zero_()
                s["exp_avg_sq"].zero_()
    params = [p.detach().full_tensor().float().cpu() for p in model.parameters()]
    run = {"losses": losses, "params": params}
    if kind == "smartinf":
        c = opt._speculation and opt._speculation.counts
        run["during_backward"] = c and {"started": c.started, "kept": c.kept, "retracted": c.retracted}
        opt.close()
    return run


def check_fsdp_reset(a, root: Path) -> dict:
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ref = "torch-fused" if a.device == "cuda" else "torch-foreach"
        other = "torch-foreach" if ref == "torch-fused" else "torch-fused"
        runs = {}
        for kind, reset in [("smartinf", True), (ref, True), (other, True),
                            ("smartinf", False), (ref, False)]:
            name = f"{kind}{'' if reset else '-noreset'}"
            runs[name] = fsdp_run(kind, reset, a, str(root / "fsdp" / name))
    finally:
        dist.destroy_process_group()
    loss = {k: r["losses"] for k, r in runs.items()}
    gaps = lambda x, y: [rel(p, q) for p, q in zip(loss[x], loss[y])]  # noqa: E731
    floor = max(gaps(other, ref))
    gap = max(gaps("smartinf", ref))
    # 4 x the floor; at least 1e-3 with bf16 compute (an eighth of bf16's epsilon 2^-7: runs
    # apart by fp32 roundings stay far below it), 1e-5 in fp32 (torch's operations, each rounded once)
    tol = max(4 * floor, 1e-3 if a.device == "cuda" else 1e-5)
    reset_effect = max(gaps("smartinf", "smartinf-noreset"))
    out = {"reference": ref, "losses": loss, "noise_floor": floor, "gap": gap, "tolerance": tol,
           "gap_noreset": max(gaps("smartinf-noreset", f"{ref}-noreset")),
           "reset_effect_smartinf": reset_effect,
           "reset_effect_torch": max(gaps(ref, f"{ref}-noreset")),
           "param_gap": param_gap(runs["smartinf"]["params"], runs[ref]["params"]),
           "param_floor": param_gap(runs[other]["params"], runs[ref]["params"]),
           "param_reset_effect": param_gap(runs["smartinf"]["params"],
                                           runs["smartinf-noreset"]["params"]),
           "during_backward": runs["smartinf"].get("during_backward")}
    # the reset must move both runs far beyond the tolerance (else the check tells nothing)
    out["passed"] = gap <= tol and min(reset_effect, out["reset_effect_torch"]) >= 5 * tol
    print(f"\n[1] FSDP2 world 1, moments reset after step {a.steps // 2} (reference {ref})")
    columns = ["smartinf", ref, other, "smartinf-noreset", f"{ref}-noreset"]
    print("it " + " ".join(f"{c:>17}" for c in columns))
    for i in range(a.steps):
        print(f"{i + 1:>2} " + " ".join(f"{loss[c][i]:>17.6f}" for c in columns))
    print(f"max rel loss gap smartinf vs {ref}: {gap:.3e} (noise floor {other} vs {ref}: {floor:.3e};"
          f" tolerance {tol:.3e}); without the reset: {out['gap_noreset']:.3e}\nreset's effect on the"
          f" losses: smartinf's {reset_effect:.3e}, torch's {out['reset_effect_torch']:.3e} "
          f"(each needs >= {5 * tol:.3e})\nfinal params, "
          f"max rel gap: smartinf vs {ref} {out['param_gap']:.3e}, floor {out['param_floor']:.3e},"
          f" reset vs none {out['param_reset_effect']:.3e}; updates during backward "
          f"{out['during_backward']}\n=> {'PASS' if out['passed'] else 'FAIL'}")
    return out


# -- 2. DDP world 2, a rank one commit behind -----------------------------------------------
STACKS: list = []  # (each DDP rank's file for faulthandler, kept open)


def ddp_rank(rank: int, world: int, port: int, cfg: dict) -> None:
    """One DDP rank: opens ``cfg["dir"]`` (commit_every=2), trains ``cfg["steps"]`` steps from the
    step it opens at (data by step number: a resumed run continues the uninterrupted one),
    with ``opt.save`` after ``cfg["save_at"]`` of them; its record (error or step counts,
    params' digest, the smartinf logger's warnings) as JSON in ``cfg["out"].<rank>``."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    record: dict = {"said": []}
    try:
        cuda = cfg["device"] == "cuda"
        dev = torch.device(f"cuda:{rank if cfg['backend'] == 'nccl' else 0}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(dev)
        dist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        heard = logging.Handler(logging.WARNING)
        heard.emit = lambda r: record["said"].append(r.getMessage())
        logging.getLogger("smartinf").addHandler(heard)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 16)).to(dev)
        ddp = DDP(model, device_ids=[dev.index] if cuda else None)
        try:
            opt = so.AdamW(ddp.parameters(), lr=1e-2, devices=[cfg["dir"]], commit_every=2,
                           if_exists=cfg["if_exists"])
            opt._laid_out()  # (on a GPU a budget of "auto" waits for the first step: open now)
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"
        else:
            first = record["first"] = opt.pipeline.step_count
            for step in range(first, first + cfg["steps"]):
                g = torch.Generator().manual_seed(1000 * step + rank)
                ddp(torch.randn(16, 64, generator=g).to(dev)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step + 1 - first == cfg.get("save_at"):
                    opt.save(f"{cfg['save']}/rank{rank}")
                if step + 1 - first == cfg.get("digest_at", cfg["steps"]):
                    record["digest_step"] = step + 1
                    record["digest"] = hashlib.sha256(b"".join(
                        p.detach().float().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
            opt.close()  # (the step count read before close could lag: the step's tail)
            record["durable"] = int((manifest_fields(f"{cfg['dir']}/rank{rank:05d}") or {}).get("step", -1))
    except Exception:
        record["crash"] = traceback.format_exc()[-2000:]
    finally:
        Path(f"{cfg['out']}.{rank}").write_text(json.dumps(record))
        # a rank still alive 20 s after its record leaves its threads' stacks (a hang at exit)
        STACKS.append(open(f"{cfg['out']}.{rank}.stacks", "w"))
        faulthandler.dump_traceback_later(20, file=STACKS[-1])
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(a, root: Path, name: str, **cfg) -> list:
    """Both ranks of one launch; each rank's record ({"timeout": ...} if it never wrote one)."""
    cuda = a.device == "cuda"
    backend = "nccl" if cuda and torch.cuda.device_count() >= 2 else "gloo"
    cfg = dict(cfg, device=a.device, backend=backend, dir=str(root / "run"),
               save=str(root / "saved"), out=str(root / f"{name}.json"))
    ctx = mp.start_processes(ddp_rank, (2, free_port(), cfg), nprocs=2, join=False, start_method="spawn")
    began = time.monotonic()
    deadline = began + a.timeout
    records = [Path(f"{cfg['out']}.{r}") for r in range(2)]
    try:
        while not ctx.join(timeout=2):
            if all(f.exists() for f in records):  # done: 45 s more to exit
                deadline = min(deadline, time.monotonic() + 45)
            if time.monotonic() > deadline:
                break
    except Exception as e:  # a rank died without writing its record
        print(f"  launch {name}: {str(e)[:500]}")
    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in hung:  # (ours: a hung rank ends here)
        ctx.processes[r].kill()
    took = time.monotonic() - began
    print(f"  ({name}: {took:.1f} s" + (f"; ranks {hung} never exited, killed)" if hung else ")"))
    out = [json.loads(f.read_text()) if f.exists() else {"timeout": f"no record in {a.timeout:.0f} s"}
           for f in records]
    for r in hung:
        stacks = Path(f"{cfg['out']}.{r}.stacks")
        out[r]["hung_at_exit"] = stacks.read_text()[-3000:] if stacks.exists() else "(no stacks)"
        print(f"  rank {r} hung after its record; its stacks:\n{out[r]['hung_at_exit'][-1500:]}")
    return out


def files_digest(root: Path) -> dict:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != "lock"}


def put_back_rank1(root: Path) -> None:
    shutil.rmtree(root / "run" / "rank00001", ignore_errors=True)
    shutil.copytree(root / "saved" / "rank1" / "device-0", root / "run" / "rank00001")


def check_ddp_resume(a, root: Path) -> dict:
    out: dict = {}
    root.mkdir(parents=True)
    say = lambda *s: print(*s, flush=True)  # noqa: E731
    say("\n[2] DDP world 2, commit_every=2, rank 1's directory put back behind")
    # 4 steps (durable commits at 2 and 4), each rank's directory saved after step 2
    first = out["first"] = launch(a, root, "first", if_exists="error", steps=4, save_at=2)
    saved_step = (manifest_fields(str(root / "saved" / "rank1" / "device-0")) or {}).get("step")
    ends = [r.get("error") or r.get("crash") or r.get("timeout") or r.get("durable") for r in first]
    say(f"  first run, durable steps after close: {ends}; rank 1's copy at step {saved_step}")
    # one commit behind: both ranks must open at step 2; 2 steps on, the replicas (and the
    # uninterrupted run's step 4) alike; 2 more steps leave rank 0 at 6 for the next case
    put_back_rank1(root)
    one = out["one_behind"] = launch(a, root, "one_behind", if_exists="resume", steps=4, digest_at=2)
    opened = [r.get("first") for r in one]
    same = len({r.get("digest") for r in one}) == 1 and one[0].get("digest") is not None
    as_whole = one[0].get("digest") == first[0].get("digest")
    out["one_behind_passed"] = opened == [2, 2] and same
    for r, rec in enumerate(one):
        trouble = rec.get("error") or rec.get("crash") or rec.get("timeout")
        say(f"  rank {r}: step_count after open {rec.get('first')}" + (f", {trouble}" if trouble else ""))
        for s in rec.get("said", []):
            if "rolled back" in s or "commit" in s and "auto:" not in s:
                say(f"    said: {s[:300]}")
    say(f"  replicas identical after 2 steps: {same}; equal to the uninterrupted run's step 4: "
        f"{as_whole} => {'PASS' if out['one_behind_passed'] else 'FAIL'}")
    out["as_uninterrupted"] = as_whole
    # two commits apart (rank 0 at 6, rank 1 at 2), then rank 1's directory missing: every rank
    # raises, nothing written
    for case in ("two_apart", "rank1_missing"):
        if case == "two_apart":
            put_back_rank1(root)
        else:
            shutil.rmtree(root / "run" / "rank00001", ignore_errors=True)
        held = [(manifest_fields(str(root / "run" / f"rank{r:05d}")) or {}).get("step") for r in range(2)]
        before = files_digest(root / "run")
        recs = out[case] = launch(a, root, case, if_exists="resume", steps=1)
        unchanged = files_digest(root / "run") == before
        errors = [r.get("error") for r in recs]
        out[f"{case}_passed"] = all(errors) and unchanged
        say(f"  {case} (durable steps held: rank 0 {held[0]}, rank 1 {held[1]}): every rank "
            f"raised: {all(errors)}, directories unchanged: {unchanged} "
            f"=> {'PASS' if out[f'{case}_passed'] else 'FAIL'}")
        for r, rec in enumerate(recs):
            what = rec.get("error") or rec.get("crash") or rec.get("timeout") or \
                f"opened at step {rec.get('first')} (not refused)"
            say(f"    rank {r}: {what[:400]}")
    out["passed"] = all(out[f"{c}_passed"] for c in ("one_behind", "two_apart", "rank1_missing"))
    return out


def main() -> int:
    a = ARGS.parse_args()
    root = Path(tempfile.mkdtemp(prefix="state-checks-", dir=a.root))
    record: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                    "steps": a.steps, "root": str(root), "checks": {}}
    print(f"issue 88 state checks on {record['device']} (torch {torch.__version__}), under {root}")
    for name, check in [("fsdp_reset", check_fsdp_reset), ("ddp_resume", check_ddp_resume)]:
        try:
            record["checks"][name] = check(a, root / name)
        except Exception:
            record["checks"][name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
            print(f"\n[{name}] raised:\n{record['checks'][name]['error']}")
    record["passed"] = all(c.get("passed") for c in record["checks"].values())
    print("\n" + "  ".join(f"{k}: {'PASS' if c.get('passed') else 'FAIL'}"
                           for k, c in record["checks"].items()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1, default=str))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
