"""smartinf.integrations.deepspeed against DeepSpeed's own ZeRO-3 + DeepSpeedCPUAdam.

Each run is examples/deepspeed/train.py in ranks launched as torch.distributed.run launches
them (gloo on CPU: its environment, rendezvous and failure handling; forked from a process
with DeepSpeed imported, tests/warm.py, but for one launch through torch.distributed.run
itself), so the integration is tested as users run it: same model, same batches, same
config but for where the optimizer runs, with DeepSpeed's default stage3_param_persistence_threshold
(all of the tiny model's params but the embedding stay gathered). DeepSpeed's fp32
accessors and checkpoint tools run once in tests/deepspeed_api.py. DeepSpeed's JIT ops
(cpu_adam, shm comm) build once into TORCH_EXTENSIONS_DIR (the Makefile points it at
build/torch_extensions).
"""
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warm
from conftest import free_port, made_once

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'smartinf[deepspeed]')")
import smartinf  # noqa: E402
import smartinf.integrations.deepspeed as sds  # noqa: E402
import smartinf.integrations.deepspeed_config as sds_config  # noqa: E402
from smartinf.planning import gpu_budget, space  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "deepspeed" / "train.py"
STEPS = 8


# What the launches' processes import before their first line (tests/warm.py's zygote has them
# imported once; DeepSpeed's optimizer check imports its Muon, which decorates with
# torch.compile: torch._dynamo and torch._inductor).
WARM = ("torch", "deepspeed", "smartinf.integrations.deepspeed", "examples.deepspeed.train",
        "deepspeed.runtime.zero.muon.muon_optimizer")


def launch_env(world: int = 1) -> dict:
    # The streamed path these tests were written for, durable every step (a block with only
    # "devices" gets the planner's placement: test_the_blocks_defaults_train_as_streaming); a
    # block's own "memory_budget" or "commit_every" wins over these.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("SMARTINF_MEMORY_BUDGET", "0")
    env.setdefault("SMARTINF_COMMIT_EVERY", "1")
    if torch.cuda.device_count() < world:  # (a rank a GPU, or all on the host: gloo)
        env["DS_ACCELERATOR"] = "cpu"
    return env


def torchrun(world: int, script: Path, *args: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=world script args`` as tests/warm.py launches it: the ranks
    forked from a process that has DeepSpeed imported (a fresh one's environment, argv and
    rendezvous; the first rank to fail ends the others). ``fresh``: torch.distributed.run
    itself, its ranks fresh interpreters (as users launch; one test's launch keeps it so)."""
    return warm.run("deepspeed", WARM, [script, *args], world=world, env=launch_env(world),
                    port=free_port(), fresh_=fresh)


def train(tmp: Path, storage: str, name: str, *, mode: str = "smartinf", world: int = 1,
          extra: tuple = (), fails_with: str = "") -> dict:
    """Runs the example; returns its per-step record and final params (or, when it must
    fail, checks that ``fails_with`` is in its output)."""
    out = tmp / name
    done = torchrun(world, SCRIPT, "--mode", mode, "--dir", storage, "--steps", str(STEPS),
                    "--json", f"{out}.json", "--params-out", f"{out}.pt", *extra)
    if fails_with:
        assert done.returncode != 0 and fails_with in done.stdout + done.stderr, done.stderr[-3000:]
        return {}
    assert done.returncode == 0, \
        f"{' '.join(done.args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    record = json.loads(Path(f"{out}.json").read_text())
    record["params"] = torch.load(f"{out}.pt")
    return record


@dataclasses.dataclass
class Run:
    """One run of the example for train_all: its storage directory, its name (of its
    --json), its flags and environment."""
    storage: str
    name: str
    extra: tuple = ()
    mode: str = "smartinf"
    env: dict = dataclasses.field(default_factory=dict)


def train_all(tmp: Path, world: int, *runs: Run, fresh: bool = False) -> list:
    """The runs in turn, in one launch (tests/deepspeed_batch.py: a launch costs several
    times a run of the tiny model); their records as train's, each with its ranks' output
    ("log"). A run that fails names itself; the launch stops there."""
    spec = tmp / f"{runs[0].name}.runs.json"
    spec.write_text(json.dumps([{
        "name": r.name, "out": str(tmp), "env": r.env,
        "args": ["--mode", r.mode, "--dir", str(r.storage), "--steps", str(STEPS),
                 "--json", str(tmp / f"{r.name}.json"), "--params-out", str(tmp / f"{r.name}.pt"),
                 *r.extra]} for r in runs]))
    done = torchrun(world, ROOT / "tests" / "deepspeed_batch.py", str(spec), fresh=fresh)
    records = []
    for r in runs:
        status = tmp / f"{r.name}.done"
        assert status.is_file(), f"run {r.name} not reached ({' '.join(done.args)}):\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        assert status.read_text() == "ok", f"run {r.name} {r.extra} failed: {status.read_text()}"
        record = json.loads((tmp / f"{r.name}.json").read_text())
        record["params"] = torch.load(tmp / f"{r.name}.pt")
        record["log"] = "".join(p.read_text() for p in sorted(tmp.glob(f"{r.name}.rank*.log")))
        records.append(record)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return records


def total_read(record: dict) -> int:
    """Bytes read from storage over the run, the last step's tail included (with overlap a
    step's reads come during the next forward: per-step windows shift)."""
    return sum(s["storage_read"] for s in record["steps"]) + record["after_steps"]["storage_read"]


def losses(record: dict) -> list:
    return [s["loss"] for s in record["steps"]]


def params_rel_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every parameter."""
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a["params"], b["params"]))
    den = sum(float(y.double().pow(2).sum()) for y in b["params"])
    return math.sqrt(num / den)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("deepspeed")


@pytest.mark.parametrize("world", [1, 2])
def test_fp32_matches_deepspeed_zero3_cpu_adam(work, disk_dir, world):
    """Loss-for-loss equal to DeepSpeed's ZeRO-3 + CPU Adam, including a skipped step
    (NaN gradients at step 3: DeepSpeed's overflow check must keep the states as they
    were) and gradient clipping (clip 1.0 acts on this model's early steps)."""
    extra = ("--nan-at", "3")
    ours, ref = train_all(work, world, Run(disk_dir, f"ours-{world}", extra),
                          Run(disk_dir, f"ref-{world}", extra, mode="deepspeed-cpu"),
                          fresh=world == 2)  # (torch.distributed.run itself, fresh ranks)
    assert [s["skipped"] for s in ours["steps"]] == [s["skipped"] for s in ref["steps"]]
    assert [s["skipped"] for s in ours["steps"]].count(True) == 1
    for step, (a, b) in enumerate(zip(losses(ours), losses(ref)), 1):
        if step == 3:
            assert math.isnan(a) and math.isnan(b)
        else:
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert losses(ours)[-1] < losses(ours)[0]  # it trains
    assert params_rel_diff(ours, ref) <= 1e-5
    # The states live on storage: every applied step reads and writes this rank's share
    # (counted over the run: with overlap a step's updates finish in the next forward, and the
    # last one's when the optimizer settles).
    params = ours["num_params"]
    applied = sum(not s["skipped"] for s in ours["steps"])
    written = sum(s["storage_written"] for s in ours["steps"]) + ours["after_steps"]["storage_written"]
    assert total_read(ours) >= 12 * params / world * (applied - 1)  # the first may not read
    assert written >= 12 * params / world * applied


def test_resident_states_and_a_commit_interval_train_identically(work, disk_dir):
    """The block's memory_budget (all states resident, with room for their twins) and
    commit_every=3, two ranks: the same losses and params, bit for bit, as streaming every
    step; states are not read. Durable commits are written in the background (overlap, the
    default) while the next steps update the twins (rank 0's pinned copies counted). Where
    the states' directory has a probe record, the example records the model's step for rank
    0's placement (all resident here), its host shared by the two ranks; without one, none."""
    from smartinf.planning import io_schedule, placement
    figures = {"read_bps": 2e9, "write_bps": 1e9, "write_beside_update_bps": 0.5e9,
               "triad": {"bps": 1e10},
               "kernel": [{"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32",
                           "threads": 2, "master": "fp32", "params_per_s": 1e8}]}
    os.makedirs(os.path.join(disk_dir, "probed"), exist_ok=True)
    io_schedule.record(os.path.join(disk_dir, "probed"), figures)
    plain, tiered = train_all(work, 2, Run(os.path.join(disk_dir, "plain"), "plain-2"), Run(
        os.path.join(disk_dir, "probed", "tiered"), "tiered-2",
        ("--memory-budget", "8MiB", "--commit-every", "3", "--compute-threads", "2")))
    assert plain["predicted"] is None
    placed = tiered["predicted"]["placement"]
    assert placed["gpu"] == placed["streamed"] == 0 and 0 < placed["ram"] <= tiered["num_params"]
    # the two ranks of this host step at once: each has half its memory, cores and disk
    want = placement.predict_placed(placement.Placement(**placed),
                                **placement.rank_share(placement.recorded_rates(figures, "fp32", "fp32"), 2),
                                commit_every=3)
    assert tiered["predicted"]["step_s"] == pytest.approx(want.step_s)
    assert losses(tiered) == losses(plain)
    assert params_rel_diff(tiered, plain) == 0.0
    assert tiered["smartinf"]["commit_every"] == 3
    assert sum(s["pipeline"]["twin_copies"] for s in tiered["steps"]) > 0
    # counted over the run (with overlap a step's reads come during the next forward)
    per_rank = 12 * tiered["num_params"] / 2
    assert total_read(tiered) < per_rank / 2
    assert total_read(plain) >= per_rank * (STEPS - 1)


@pytest.mark.parametrize("world", [1, 2])
def test_updates_during_backward_change_no_bit(work, disk_dir, world):
    """overlap (the default): each sub-group's update starts when its gradient partitions are
    reduced, with the last step's scale assumed; kept where it held, retracted where not
    (step 3's NaN gradients: skipped; with clip 1.0, acting on every step here, a step after
    a clipped one starts nothing; resident sub-groups start nothing: a speculative update
    would work on a second copy). Updates start while fewer than two are unfinished; the
    rest, and those kept, finish while the next forward runs (each gather waits for its
    sub-group). Losses and final params bit for bit those of --no-overlap, streamed and all
    resident (sub-groups of 60 k params: several per rank); and resident ones speculating on
    their twins (SMARTINF_SPECULATE_RESIDENT)."""
    resident = ("--clip", "0", "--memory-budget", "8MiB")
    cases = (("streamed", ("--clip", "0")), ("clipped", ()), ("resident", resident),
             ("resident-twins", resident))
    runs = []
    for name, extra in cases:
        env = {"SMARTINF_SPECULATE_RESIDENT": str(int(name == "resident-twins"))}
        extra = ("--nan-at", "3", "--sub-group-size", "60000", *extra)
        runs += [Run(os.path.join(disk_dir, f"spec-{name}-{world}"), f"spec-{name}-{world}",
                     extra, env=env),
                 Run(os.path.join(disk_dir, f"nospec-{name}-{world}"), f"nospec-{name}-{world}",
                     (*extra, "--no-overlap"), env=env)]
    records = iter(train_all(work, world, *runs))
    for (name, _), on, off in zip(cases, records, records):
        assert [str(x) for x in losses(on)] == [str(x) for x in losses(off)], name
        assert params_rel_diff(on, off) == 0.0, name
        started = [s["pipeline"]["speculative_updates"] for s in on["steps"]]
        retracted = [s["pipeline"]["retracted_updates"] for s in on["steps"]]
        assert sum(s["pipeline"]["speculative_updates"] for s in off["steps"]) == 0
        assert on["throughput_timer_synchronized"] is False  # (it would wait for a GPU's tail)
        # the updates not kept from backward finished while the next forward ran
        assert sum(s["pipeline"]["deferred_updates"] for s in on["steps"]) > 0, name
        assert sum(s["pipeline"]["deferred_updates"] for s in off["steps"]) == 0, name
        # the tail drained (by the next backward) and committed; where step() went, within it
        assert sum(s["pipeline"]["drain_s"] for s in on["steps"]) > 0, name
        for s in on["steps"] + off["steps"]:
            phases = s["step_phases"]
            assert min(phases.values()) >= 0 and sum(phases.values()) <= s["step_s"], (name, s)
            assert phases["pipeline_s"] == s["pipeline_s"]
        assert on["steps"][2]["step_phases"]["pipeline_s"] == 0.0  # the skipped step's
        if name == "clipped":  # clip 1.0 acts on every step of this model: nothing starts
            assert all(s["grad_norm"] > 1.0 for s in on["steps"])
            assert sum(started) == 0, name
        elif name == "resident":  # left to the tail: updated in place after backward
            assert sum(started) == 0, name
        else:  # from step 2 on, but in step 3 (NaN: all retracted) and 4 (after a skip)
            assert retracted[2] == started[2] > 0, name
            assert started[3] == 0, name
            assert all(started[i] > 0 and retracted[i] == 0 for i in range(1, STEPS)
                       if i not in (2, 3)), name


def test_gradients_set_through_deepspeed_between_backward_and_step(work, disk_dir):
    """Step 4's gradients halved between backward and step through DeepSpeed's own
    safe_get_full_grad / safe_set_full_grad, at world 2: the step uses them, as DeepSpeed's
    ZeRO-3 + CPU Adam does (loss for loss); the updates started during backward from the
    unhalved partitions are redone (their digests differ: no version counter moved), so the
    run is bit for bit the one with --no-overlap."""
    extra = ("--halve-grads-at", "4", "--clip", "0", "--sub-group-size", "60000")
    on, off, ref, plain = train_all(
        work, 2, Run(os.path.join(disk_dir, "halve-on"), "halve-on", extra),
        Run(os.path.join(disk_dir, "halve-off"), "halve-off", (*extra, "--no-overlap")),
        Run(disk_dir, "halve-ref", extra, mode="deepspeed-cpu"),
        Run(os.path.join(disk_dir, "halve-none"), "halve-none", extra[2:]))
    assert [str(x) for x in losses(on)] == [str(x) for x in losses(off)]
    assert params_rel_diff(on, off) == 0.0
    for step, (a, b) in enumerate(zip(losses(on), losses(ref)), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert losses(on)[4] != losses(plain)[4]  # the halved gradients were the ones stepped
    retracted = [s["pipeline"]["retracted_updates"] for s in on["steps"]]
    started = [s["pipeline"]["speculative_updates"] for s in on["steps"]]
    assert started[3] > 0 and retracted[3] == started[3]


def test_four_ranks_with_overlap_train_bit_for_bit_as_without(work, disk_dir):
    """World 4 (one host's ranks, each with its own slice of the cores and its own
    directories): updates during backward and the step's tail change no bit against
    --no-overlap, and every rank ends at the same durable step."""
    extra = ("--nan-at", "3", "--sub-group-size", "60000", "--clip", "0")
    on, off = train_all(work, 4, Run(os.path.join(disk_dir, "spec-4"), "spec-4", extra),
                        Run(os.path.join(disk_dir, "nospec-4"), "nospec-4", (*extra, "--no-overlap")))
    assert on["world_size"] == off["world_size"] == 4
    assert [str(x) for x in losses(on)] == [str(x) for x in losses(off)]
    assert params_rel_diff(on, off) == 0.0
    assert sum(s["pipeline"]["speculative_updates"] for s in on["steps"]) > 0
    # the record sums the host's disk over the ranks (each writes its own partition's states)
    written = sum(s["storage_written"] for s in off["steps"])
    assert written > 0 and sum(s["host_storage_written"] for s in off["steps"]) > 3 * written
    for run in ("spec-4", "nospec-4"):
        steps = []
        for rank in range(4):
            with _reopened(os.path.join(disk_dir, run, "smartinf", f"rank{rank:05d}")) as pipe:
                steps.append(pipe.durable_step_count)
        assert steps == [STEPS - 1] * 4, (run, steps)  # every step but the skipped one


def test_lion_matches_deepspeed_cpu_lion(work, disk_dir):
    """A config "Lion" block: loss-for-loss DeepSpeed's own Lion (ZeRO-3, CPU offload,
    DeepSpeedCPULion), with 8 B/param of states on storage. The params are not compared:
    where momentum and gradient are both exactly 0 (embedding rows of unseen tokens)
    DeepSpeed's CPU Lion steps by -lr (copysign), the paper and torch.sign by 0; smartinf
    follows the paper (tests/test_optim.py checks it against a torch reference)."""
    extra = ("--optimizer", "lion")
    ours, ref = train_all(work, 1, Run(disk_dir, "ours-lion", extra),
                          Run(disk_dir, "ref-lion", extra, mode="deepspeed-cpu"))
    for step, (a, b) in enumerate(zip(losses(ours), losses(ref)), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert losses(ours)[-1] < losses(ours)[0]
    n = ours["num_params"]
    assert 8 * n * (STEPS - 1) <= total_read(ours) < 12 * n * STEPS  # Lion: 8 B/param a step


def test_the_zenflow_peer_trains(work, disk_dir):
    """The head-to-heads' stall-free peer, ``--mode zenflow`` (ZeRO-Offload at stage 2 with
    ZenFlow's tutorial settings; not exact by design): DeepSpeed takes its ZenFlow optimizer
    on the example's model and batches, and the loss falls."""
    zenflow, = train_all(work, 1, Run(disk_dir, "zenflow", mode="zenflow"))
    assert "Zenflow" in zenflow["log"]
    assert losses(zenflow)[-1] < losses(zenflow)[0]


def test_bf16_within_noise_of_deepspeed(work, disk_dir):
    ours, ref = train_all(work, 1, Run(disk_dir, "ours-bf16", ("--dtype", "bf16")),
                          Run(disk_dir, "ref-bf16", ("--dtype", "bf16"), mode="deepspeed-cpu"))
    assert losses(ours)[:3] == losses(ref)[:3]  # before rounding noise can differ
    for a, b in zip(losses(ours), losses(ref)):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert ours["params"][0].dtype == torch.float32  # gathered as fp32 copies of bf16


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_split_master_trains_bf16_bit_for_bit(work, disk_dir, state_dtype):
    """bf16 ZeRO-3 for 120 steps with master="split" (the devices keep the masters' low
    halves, the bf16 partitions are the high ones): the same losses and params, bit for bit,
    as with fp32 masters, reading 2 B per param less from storage every step."""
    extra = ("--dtype", "bf16", "--steps", "120", "--state-dtype", state_dtype)
    fp32, split = train_all(work, 1, Run(f"{disk_dir}/fp32", f"bf16-{state_dtype}-fp32", extra),
                            Run(f"{disk_dir}/split", f"bf16-{state_dtype}-split",
                                (*extra, "--split-master")))
    assert losses(split) == losses(fp32) and len(losses(fp32)) == 120
    for a, b in zip(split["params"], fp32["params"]):
        assert torch.equal(a, b)
    # the median step's reads: /proc/self/io counts every read of the process, and module
    # pages read during a run (30-36 MB over these, unevenly: the totals' difference came
    # out at 2.2 and 3.5 B/param) fall in some steps (with overlap a step's reads come during
    # the next forward; in steady state each step's window holds one step's)
    saved = (statistics.median(s["storage_read"] for s in fp32["steps"]) -
             statistics.median(s["storage_read"] for s in split["steps"])) / fp32["num_params"]
    assert abs(saved - 2) < 0.2  # + 4 KiB extents


def test_one_copy_on_disk_trains_as_two_and_resumes(work, disk_dir):
    """The block's copies=1 (every state resident, durable every 3 steps, two ranks): the
    same losses and params, bit for bit, as streaming with two copies, on half the disk per
    state; a run again with if_exists="resume" goes on from the last durable step."""
    one = ("--memory-budget", "8MiB", "--commit-every", "3", "--copies", "1")
    storage = os.path.join(disk_dir, "one")
    plain, first, again = train_all(  # in turn: the last resumes the second's directories
        work, 2, Run(os.path.join(disk_dir, "plain"), "plain-two-copies"),
        Run(storage, "one-copy", one), Run(storage, "one-copy-again", (*one, "--if-exists", "resume")))
    assert losses(first) == losses(plain) and params_rel_diff(first, plain) == 0.0
    assert first["smartinf"]["copies"] == 1
    for rank in range(2):
        held = os.path.getsize(os.path.join(storage, "smartinf", f"rank{rank:05d}", "states.bin"))
        two = os.path.getsize(os.path.join(disk_dir, "plain", "smartinf", f"rank{rank:05d}", "states.bin"))
        assert 2 * held == two
    assert losses(again)[0] < losses(first)[0] - 0.05


def test_reopened_directories_resume_where_the_last_run_stopped(work, disk_dir):
    """Without a checkpoint, a new run on the same directories continues from their last
    committed step (master weights back into the model), as smartinf.optim does."""
    first = train(work, disk_dir, "first")
    train(work, disk_dir, "again", fails_with="holds the states of an earlier run")  # a choice
    second = train(work, disk_dir, "second", extra=("--if-exists", "resume"))
    assert losses(second)[0] < losses(first)[0] - 0.05
    assert losses(second)[0] != losses(first)[-1]  # a new batch after step 8's update


def test_checkpoint_resumes_identically_in_a_fresh_process(work, disk_dir):
    """Save at step 4 of 8, then a new process (same storage directories, which by then
    hold step 8) loads the checkpoint: steps 5-8 repeat exactly (the persistent params,
    gathered at load, included)."""
    ckpt = str(work / "ckpt")
    first, again = train_all(work, 2, Run(disk_dir, "ckpt-first", ("--save", ckpt, "--save-at", "4")),
                             Run(disk_dir, "ckpt-again", ("--load", ckpt, "--if-exists", "overwrite")))
    assert [s["step"] for s in again["steps"]] == [5, 6, 7, 8]
    assert losses(again) == losses(first)[4:]
    assert all(torch.equal(a, b) for a, b in zip(again["params"], first["params"]))
    for rank in (0, 1):
        saved = Path(ckpt) / "global_step4" / "smartinf" / f"rank{rank:05d}" / "device-0"
        assert (saved / "manifest").is_file() and (saved / "states.bin").stat().st_size > 0
    # Ranks more than one commit apart are refused on reopen, naming each rank's step.
    older = Path(ckpt) / "global_step4" / "smartinf" / "rank00001" / "device-0"
    live = Path(disk_dir) / "smartinf" / "rank00001"
    for f in ("states.bin", "manifest"):
        shutil.copyfile(older / f, live / f)
    train(work, disk_dir, "ckpt-mixed", world=2, extra=("--if-exists", "resume"),
          fails_with="hold different durable steps (rank 0: step 8, rank 1: step 4)")


def test_a_bf16_checkpoint_resumes_bit_for_bit(work, disk_dir):
    """bf16 params over fp32 masters (no split): a checkpoint loaded in a new process puts
    the masters into the partitions rounded as the devices round them (ties away from
    zero, not torch's nearest-even), so steps 5-8 repeat bit for bit."""
    ckpt, bf16 = str(work / "ckpt-bf16"), ("--dtype", "bf16")
    first, again = train_all(work, 1, Run(disk_dir, "bf16-first", (*bf16, "--save", ckpt, "--save-at", "4")),
                             Run(disk_dir, "bf16-again", (*bf16, "--load", ckpt, "--if-exists", "overwrite")))
    assert losses(again) == losses(first)[4:]
    assert all(torch.equal(a, b) for a, b in zip(again["params"], first["params"]))


def test_a_split_master_resumes_from_a_checkpoint_and_refuses_without_its_weights(work, disk_dir):
    """bf16 with a split master: the directories hold the masters' low halves only. Loading a
    checkpoint puts the high halves back (the partitions from the checkpoint's masters, which
    a ZeRO-3 module file does not hold): steps 5-8 repeat exactly. Resuming the directories
    without the weights of their step (a freshly built model) is refused at the first step,
    before it commits (it used to train on from the initial weights with a warning)."""
    split = ("--dtype", "bf16", "--split-master")
    ckpt = str(work / "split-ckpt")
    first, again = train_all(
        work, 1, Run(disk_dir, "split-ckpt-first", (*split, "--save", ckpt, "--save-at", "4")),
        Run(disk_dir, "split-ckpt-again", (*split, "--load", ckpt, "--if-exists", "overwrite")))
    assert losses(again) == losses(first)[4:]
    assert all(torch.equal(a, b) for a, b in zip(again["params"], first["params"]))
    train(work, disk_dir, "split-no-weights", extra=(*split, "--if-exists", "resume"),
          fails_with="whose directories hold only the low halves of the fp32 masters")


# -- DeepSpeed's accessors and checkpoint tools (one run of tests/deepspeed_api.py) --------
TOL = 1e-5  # ours vs DeepSpeed's torch AdamW, relative: float rounding of the two kernels


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    def make(work: Path) -> None:  # (once for all of pytest-xdist's workers)
        done = torchrun(2, ROOT / "tests" / "deepspeed_api.py", "--dir", str(work / "api"),
                        "--out", str(work / "api.json"))
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    results = json.loads((made_once(tmp_path_factory, "deepspeed-api", make) / "api.json").read_text())
    for ours, ref in zip(*results["losses"]):  # the first two steps
        assert abs(ours - ref) <= TOL * abs(ref)
    return results


def ok(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


def assert_close_to_deepspeed(result: dict) -> None:
    for key in ("None", "exp_avg", "exp_avg_sq", "local"):
        assert result[key] <= TOL, (key, result)
    ours, ref = result["loss"]
    assert abs(ours - ref) <= TOL * abs(ref)


def test_config_given_in_args_deepspeed_config(api):
    """initialize(args=args) with args.deepspeed_config = "ds.json", as with DeepSpeed."""
    assert ok(api["config_in_args"]) == {"ok": True}


def test_a_gather_right_after_step_waits_for_the_step(api):
    """GatheredParameters between step() and the next forward, while the step's updates
    still finish (overlap): it waits for them and gives the updated params."""
    got = ok(api["gather_waits_for_the_step"])
    assert got["waited_for"] > 0  # the step had updates left when the gather came
    assert got["vs_masters"] == 0.0


def test_the_norm_by_subgroup_is_deepspeeds_bit_for_bit(api):
    """step()'s gradient norms by sub-group, reduced over the two ranks in one all-reduce
    (deepspeed_norm.py), are DeepSpeed's own _get_norm_groups to the bit on the host, finite
    and with an inf in one sub-group (its -1); on GPUs to the order of the fp64 additions
    (square_sum: within 2 (n + k + 1) ulps, n elements and k tensors in all)."""
    got = ok(api["norms_by_subgroup"])
    assert got["groups"] >= 3 and got["batched"]
    for case in ("finite", "inf"):
        ours, theirs, same = got[case]
        if got["device"] == "cpu":
            assert same and ours == theirs, (case, ours, theirs)
        else:
            bound = 2 * (got["numel"] + got["tensors"] + 1) * 2.0**-53
            assert all(abs(a - b) <= bound * abs(b) for a, b in zip(ours, theirs)), (case, ours, theirs)
    assert got["finite"][0][1] > 0 and got["inf"][0][1] == -1.0
    assert [n for i, n in enumerate(got["inf"][0]) if i != 1] == \
        [n for i, n in enumerate(got["finite"][0]) if i != 1]


def test_offload_states_round_trips_bit_for_bit(api):
    """DeepSpeed's test_offload_states.py ZeRO-3 cases (each OffloadStateTypeEnum, then all;
    pin_memory and non_blocking off and on) through the block: offloaded states in host
    memory (the reduce buckets freed), the pipeline parked (refusing calls) exactly when the
    masters or moments are included, every state equal after reload_states(), and training
    going on bit for bit as an engine's that never offloaded (tests/deepspeed_offload.py)."""
    got = ok(api["offload_states"])
    cases = got["cases"]
    assert len(cases) == 12, cases
    stored = {"hp_params", "optim_states"}
    for case in cases:
        name = case["state"]
        for state, where in case["offloaded"].items():
            assert where == ([] if state == "contiguous_grad_buffer" else ["cpu"]), case
        assert case["parked"] == (name is None or name in stored), case
        assert case["restored"] and case["as_without"] and case["unparked"], case
        assert case["reloaded"].get("contiguous_grad_buffer", ["cpu"]) == ["cpu"], case
    assert "parked" in got["refused"] and "reload_states" in got["refused"], got["refused"]
    assert got["then_as_without"] and got["losses"][0] == got["losses"][1], got["losses"]
    assert all(math.isfinite(x) for x in got["losses"][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_states_frees_the_gpu_states_and_trains_on_bit_for_bit(tmp_path):
    """On a GPU, the states in its memory: offload_states() frees at least their bytes of the
    device's memory (the pipeline's CUDA buffers parked in host memory, DeepSpeed's own
    partitions and buffers moved by its code) through a phase that uses it, and after
    reload_states() training goes on bit for bit as an engine's that never offloaded."""
    out = tmp_path / "gpu.json"
    done = torchrun(1, ROOT / "tests" / "deepspeed_offload.py", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["resident"] == got["subgroups"] > 0, got
    assert got["freed"] >= got["states"], got
    assert got["before"] - got["offloaded"] >= got["states"], got
    assert got["during"] <= got["before"] - got["states"] // 2, got
    assert got["equal"] and got["losses"][0] == got["losses"][1], got


def test_gradients_set_after_step_change_nothing(api):
    """safe_set_full_grad between step() and the next forward, while the step's updates may
    still finish: as in DeepSpeed, whose step has used the gradients, nothing changes (the
    step's updates are waited for before the gradient buffer is written)."""
    got = ok(api["grads_set_after_step"])
    assert got["pending_at_set"] and not got["pending_after"], got
    assert_close_to_deepspeed(got)


def test_the_tail_is_launched_after_deepspeeds_post_step(api):
    """The step's updates left to finish during the next forward are launched only after
    DeepSpeed's post step: its gather of the kept-whole params synchronizes the device,
    which on a GPU waits for all of them (by its counters, most of the 65B shape's 14 s
    step())."""
    got = ok(api["tail_launched_after_the_post_step"])
    assert got["open"] and got["after_step"], got  # the step left updates to the tail
    assert got["at_post"] == [], got  # none of them launched before the post step


def test_a_load_right_after_step_is_not_overwritten_by_the_step(api):
    """load_checkpoint(load_module_only=True) while the last step's updates may still run:
    the masters are the checkpoint's weights, as in DeepSpeed."""
    got = ok(api["load_right_after_step"])
    assert got["None"] <= TOL and got["local"] <= TOL, got


def test_a_failed_commit_keeps_the_step(api):
    """Under DeepSpeed, a durable commit that fails (commit_every=1) raises and undoes
    nothing: the step stands (the params moved by its update, the step counted), the
    directories stay at the step before, and the next step's commit makes both durable; in
    fp32 and in bf16. (Before, the devices and params went back to the step before.)"""
    for dtype, got in ok(api["failed_commit_keeps_the_step"]).items():
        assert got["errno"] == 28, dtype
        assert got["steps"][1] == got["steps"][0] + 1 and got["durable"] == got["steps"][0], (dtype, got)
        assert got["kept_whole"] > 0 and got["moved"] > 0.0, (dtype, got)
        assert all(math.isfinite(x) for x in got["then"]), dtype
        assert got["durable_then"] == got["steps"][1] + 1, (dtype, got)


def test_safe_get_fp32_params_and_optimizer_states_read_the_devices(api):
    """deepspeed.utils.safe_get_full_fp32_param / _optimizer_state / safe_get_local_fp32_param
    give the same masters and Adam states as DeepSpeed's after two steps."""
    got = ok(api["accessors"])
    assert got["master_vs_model"] == 0.0  # fp32: the model's params are the masters
    for key in ("None", "exp_avg", "exp_avg_sq", "local"):
        assert got[key] <= TOL, (key, got)


def test_safe_set_fp32_params_and_optimizer_states_write_the_devices(api):
    """safe_set_full_fp32_param, safe_set_full_optimizer_state and safe_set_local_fp32_param
    on both, then a step: the same loss and states as DeepSpeed's."""
    got = ok(api["setters"])
    assert got["set_then_get"] == [0.0, 0.0]
    assert_close_to_deepspeed(got)


def test_zero_to_fp32_gives_the_device_masters(api):
    """The checkpoint holds the devices' masters in DeepSpeed's fp32 groups:
    get_fp32_state_dict_from_zero_checkpoint (zero_to_fp32.py) consolidates them."""
    got = ok(api["zero_to_fp32"])
    assert got["vs_masters"] == 0.0
    assert got["vs_deepspeed"] <= TOL


@pytest.mark.parametrize("how", ["load_optimizer_states", "load_module_only"])
def test_partial_checkpoint_loads_match_deepspeed(api, how):
    """load_checkpoint(load_optimizer_states=False) (module from the consolidated fp32
    masters, masters from the module, fresh optimizer states) and load_module_only=True
    (refresh_fp32_params) of our checkpoint into fresh engines, ours and DeepSpeed's own:
    the same masters, to the bit, and the same next step."""
    got = ok(api[f"load_{how}"])
    assert got["after_load"] == {"None": 0.0, "local": 0.0}
    assert_close_to_deepspeed(got)


def test_save_checkpoint_checks_its_arguments_before_copying(api):
    """save_dir None or "": DeepSpeed's ValueError, and nothing copied (into ./global_step*)."""
    got = ok(api["bad_save_dir"])
    for d in ("None", "''"):
        assert got[f"ours {d}"] == got[f"ref {d}"]
        assert got[f"ours {d}"].startswith("ValueError")
    assert not [f for f in got["written"] if f.startswith("global_step")]


# -- AMSGrad and maximize (runs of tests/deepspeed_rules.py) ---------------------------------
RULE_CASES = {1: ("adamw_amsgrad", "adam_amsgrad_maximize", "adamw_maximize", "lion_maximize",
                  "sgd_maximize", "adagrad_maximize"),
              2: ("adam_amsgrad_maximize", "lion_maximize")}


@pytest.fixture(scope="module")
def rule_runs(tmp_path_factory):
    """A world size's results, from one torchrun of all its cases (made on first use, once
    for all of pytest-xdist's workers)."""
    def get(world: int) -> dict:
        def make(work: Path) -> None:
            extra = ("--refusals",) if world == 1 else ()
            done = torchrun(world, ROOT / "tests" / "deepspeed_rules.py", "--dir",
                            str(work / "rules"), "--out", str(work / "rules.json"),
                            "--cases", ",".join(RULE_CASES[world]), *extra)
            assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        return json.loads((made_once(tmp_path_factory, f"deepspeed-rules-{world}", make) /
                           "rules.json").read_text())
    return get


@pytest.mark.parametrize("world, case", [(w, c) for w, cases in RULE_CASES.items() for c in cases])
def test_amsgrad_and_maximize_match_deepspeed_zero3_with_torch_optimizers(rule_runs, world, case):
    """A config "optimizer" block with amsgrad / maximize: 8 steps (clipping acting) equal to
    DeepSpeed's own ZeRO-3 stepping its fp32 partitions with the torch optimizer (Lion: the
    paper's update in torch) given as a client optimizer: losses per step, the params and
    every stored state (AMSGrad's max_exp_avg_sq included) within 1e-5 relative."""
    got = ok(rule_runs(world)[case])
    assert got["rule"] == case.replace("_maximize", "")
    assert got["maximize"] == case.endswith("_maximize")
    compared = [k for k, v in got.items() if isinstance(v, dict) and k != "params"]
    assert compared == got["state_names"]  # every array the devices keep
    ours, ref = got["losses"]
    assert len(ours) == 8
    for step, (a, b) in enumerate(zip(ours, ref), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: {a} vs {b}"
    assert (ours[-1] > ours[0]) == got["maximize"]  # maximize ascends the loss
    for key in ["params", *compared]:
        assert got[key]["rel"] <= TOL, (key, got[key])
    if "amsgrad" in case:  # the fourth array is the running max, and it mattered
        assert got["max_below_exp_avg_sq"] == 0 and got["max_above_exp_avg_sq"] > 0


@pytest.mark.parametrize("refusal, message", [
    ("amsgrad_per_group", "amsgrad differs between param groups (adamw and adamw_amsgrad)"),
    ("adagrad_initial_per_group", "param groups differ in initial_accumulator_value"),
    ("amsgrad_int8", "adamw_amsgrad keeps fp32 states"),
], ids=["amsgrad_per_group", "adagrad_initial_per_group", "amsgrad_int8"])
def test_param_groups_that_disagree_on_the_stored_states_are_refused(rule_runs, refusal, message):
    """What fixes the devices' states (AMSGrad's fourth array, Adagrad's initial sum) is one
    for all param groups of DeepSpeed's base optimizer, and AMSGrad keeps fp32 states."""
    got = rule_runs(1)["refusals"][refusal]
    assert got.startswith("ValueError") and message in got, got


def test_topk_compression_trains(work, disk_dir):
    dense, topk = train_all(work, 1, Run(os.path.join(disk_dir, "dense"), "ours-dense"),
                            Run(os.path.join(disk_dir, "topk"), "ours-topk", ("--topk", "0.1")))
    assert losses(topk)[0] == losses(dense)[0]
    assert losses(topk)[1:] != losses(dense)[1:]  # the update used the compressed gradient
    assert losses(topk)[-1] < losses(topk)[0]


# -- configuration errors (no processes started) ---------------------------------------
BASE = {"zero_optimization": {"stage": 3}, "smartinf": {"devices": ["/tmp/x"]}}


@pytest.mark.parametrize("change, message", [
    ({"smartinf": None}, 'needs a "smartinf" block'),
    ({"smartinf": {"devices": []}}, "non-empty list of directories"),
    ({"smartinf": {"devices": ["/a"], "slot": 4}}, "unknown keys ['slot']"),
    ({"smartinf": {"devices": ["/a"], "compress": {"k": 3}}}, '"smartinf.compress" must be'),
    ({"zero_optimization": {"stage": 2}}, "ZeRO stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "remove offload_optimizer"),
    ({"zero_optimization": {"stage": 3, "cpu_offload": True}}, "remove cpu_offload"),  # legacy
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "offload_param"),
    ({"checkpoint": {"load_universal": True}}, "load_universal"),
    ({"smartinf": {"devices": ["/a"], "if_exists": "sometimes"}}, "if_exists"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True, "torch_adam": False}}},
     '"optimizer.params.amsgrad" needs torch\'s Adam(W) as the base optimizer (smartinf\'s '
     'default): remove "torch_adam": false'),
    ({"optimizer": {"type": "Adam", "params": {"maximize": True, "torch_adam": False}}},
     '"optimizer.params.maximize" needs torch\'s Adam(W)'),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "amsgrad": True}}},
     '"optimizer.params.amsgrad" is an option of Adam and AdamW'),
    ({"optimizer": {"type": "Lion", "params": {"lr": 0.1, "fp32_optimizer_states": False}}},
     "\"optimizer.params\" ['fp32_optimizer_states'] of the Lion block: smartinf's Lion takes "
     "['lr', 'betas', 'weight_decay', 'maximize']"),
])
def test_config_errors(change, message):
    config = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        sds.check_config(config)
    assert message in str(e.value)


def test_per_rank_directories_and_compression_settings():
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a", "/b"],
                                               "compress": {"ratio": 0.01, "value_dtype": "bfloat16"}}})
    assert s.rank_devices(3, gpu=1) == ["/a/rank00003", "/b/rank00003"]
    top = s.top_k()
    assert top.ratio == 0.01 and top.value_dtype == torch.bfloat16


def test_a_gpu_budget_puts_the_ranks_gpu_in_front_of_its_directories():
    import smartinf
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a", "/b"],
                                               "gpu": {"memory_budget": "2GiB"}}})
    devices = s.rank_devices(3, gpu=1)
    assert devices[0] == smartinf.CudaDevice("/a/rank00003/gpu", 1, 2 << 30)
    assert devices[1:] == ["/a/rank00003", "/b/rank00003"]
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
        "memory_budget": "2GiB", "twins": False}}})
    assert s.rank_devices(0, gpu=0)[0].twins is False
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
        "memory_budget": "2GiB", "twins": "host"}}})
    assert s.rank_devices(0, gpu=0)[0].twins == "host"
    for bad in ({"memory_budget": "lots"}, {"budget": 1}, 5, {"twins": True},
                {"memory_budget": 1, "twins": "yes"}, {"memory_budget": 1, "twins": 1}):
        with pytest.raises(ValueError, match="gpu"):
            sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": bad}})


def test_an_auto_gpu_budget_is_what_the_gpu_leaves(monkeypatch):
    """"gpu": {"memory_budget": "auto"}: the GPU's free memory when the optimizer is built,
    less what DeepSpeed allocates after it and a reserve for the activations (given, or a
    share of the GPU); a host twin where the host's memory holds it, else no twins, unless
    asked for; refused clearly without a GPU."""
    from smartinf.planning import space
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {"memory_budget": "auto"}}})
    assert s.gpu_memory_budget == "auto" and s.gpu_reserve is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="none is visible here"):
        s.with_gpu_budget(10 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 << 30, 80 << 30))
    sized = s.with_gpu_budget(10 << 30)
    assert sized.gpu_memory_budget == (50 << 30) - (10 << 30) - int((80 << 30) * 0.15)
    assert sized.gpu_twins is None and sized.gpu_sized  # chosen by fitted_to
    given = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
        "memory_budget": "auto", "reserve": "4GiB", "twins": True}}}).with_gpu_budget(45 << 30)
    assert given.gpu_memory_budget == (1 << 30) and given.gpu_twins is True
    nothing = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
        "memory_budget": "auto"}}}).with_gpu_budget(60 << 30)
    assert nothing.gpu_memory_budget == 0
    fixed = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {"memory_budget": "2GiB"}}})
    assert fixed.with_gpu_budget(10 << 30) is fixed
    with pytest.raises(ValueError, match="reserve"):
        sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
            "memory_budget": "2GiB", "reserve": "4GiB"}}})


def test_a_log_trains_each_rank_as_two_copies_do(work, disk_dir):
    """"copies": "log" under DeepSpeed (world 2, overlap off, clipping): each rank's step
    logs its gradients before its updates; the losses and params of two copies, bit for
    bit, and each rank's directory one copy of its states plus a step's gradients."""
    extra = ("--no-overlap",)
    two, log = train_all(work, 2, Run(disk_dir, "two", extra),  # in turn: one directory
                         Run(disk_dir, "log", extra + ("--copies", "log", "--if-exists", "overwrite")))
    assert losses(log) == losses(two)
    assert params_rel_diff(log, two) == 0
    for rank in (0, 1):
        assert os.path.getsize(os.path.join(disk_dir, "smartinf", f"rank{rank:05d}", "grads.bin")) > 0


def test_auto_with_a_log_asked_turns_overlap_off(work, disk_dir):
    """"state_dtype": "auto" with "copies": "log" and overlap unset (on by default): rank 0
    weighs the fp32 masters streamed (no probe record: the fewest bytes, int4), every rank
    runs that with overlap off (a speculative update would be refused with a log), bit for
    bit as those settings given by hand."""
    auto, given = train_all(work, 2, Run(f"{disk_dir}/auto", "auto-log",
                                         ("--state-dtype", "auto", "--copies", "log")),
                            Run(f"{disk_dir}/given", "given-log",
                                ("--state-dtype", "int4", "--copies", "log", "--no-overlap")))
    for rank in (0, 1):
        assert os.path.getsize(os.path.join(disk_dir, "auto", "smartinf", f"rank{rank:05d}", "grads.bin")) > 0
    assert losses(auto) == losses(given)
    assert params_rel_diff(auto, given) == 0


def test_an_auto_gpu_budget_is_fitted_to_the_ranks_sub_groups(monkeypatch):
    """Once a budget of "auto" is sized: the GPU holds whole sub-groups first (as the
    pipeline places them), the host's budget (sized by the plan for all of the states)
    shrinks to twice what is left, at least 1 MiB; a host twin of what the GPU holds where
    the host's memory takes it (the GPU's budget then shrinks to that), else no twins;
    twins asked for are kept, and a budget given in bytes is not fitted."""
    from smartinf import _native
    from smartinf.planning import space
    mib = 1 << 20
    monkeypatch.setattr(space, "available_memory", lambda: 1 << 50)
    block = {"devices": ["/a", "/b"], "memory_budget": 3000 * mib, "chunk": 1 << 20,
             "gpu": {"memory_budget": "auto"}}
    per = _native.state_bytes("fp32", "fp32", 1 << 20)  # 12 MiB a full chunk, aligned
    assert per == 12 * mib
    s = dataclasses.replace(sds.Settings.from_config({"smartinf": block}),
                            gpu_memory_budget=100 * mib, gpu_sized=True)
    whole = s.fitted_to([2 << 20] * 4, 3)  # 24 MiB each: all four on the GPU
    assert whole.gpu_twins == "host" and whole.gpu_memory_budget == 96 * mib
    assert whole.pipeline.memory_budget == mib // 2  # 1 MiB over two directories
    some = s.fitted_to([3 << 20] * 4, 3)  # 36 MiB each: two on the GPU
    assert some.gpu_memory_budget == 72 * mib and some.pipeline.memory_budget == 72 * mib
    moved = dataclasses.replace(s, gpu_host_budget=6000 * mib,
                                pipeline=dataclasses.replace(s.pipeline, memory_budget=0))
    fitted = moved.fitted_to([3 << 20] * 4, 3)
    assert fitted.gpu_host_budget == 144 * mib and fitted.pipeline.memory_budget == 0
    assert s.fitted_to([2 << 20] * 4, 2).gpu_memory_budget == 64 * mib  # 8 MiB a chunk
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    none = s.fitted_to([2 << 20] * 4, 3)
    assert none.gpu_twins is False and none.gpu_memory_budget == 100 * mib
    asked = dataclasses.replace(s, gpu_twins=True).fitted_to([2 << 20] * 4, 3)
    assert asked.gpu_twins is True and asked.pipeline.memory_budget == 48 * mib  # 2 x 48 there
    given = dataclasses.replace(s, gpu_sized=False)
    assert given.fitted_to([2 << 20] * 4, 3) is given


def test_an_auto_gpu_budget_is_fitted_in_the_chunks_of_the_run_it_resumes(monkeypatch, tmp_path):
    """Without a chunk given, the pipeline takes the held run's (else a GPU's, 16 Mi): the
    bytes a sub-group takes are reckoned in those chunks, each 4 KiB-aligned."""
    from smartinf.planning import space
    monkeypatch.setattr(space, "available_memory", lambda: 1 << 50)
    block = {"devices": [str(tmp_path / "run")], "gpu": {"memory_budget": "auto"}}
    s = dataclasses.replace(sds.Settings.from_config({"smartinf": block}),
                            gpu_memory_budget=1 << 30, gpu_sized=True)
    assert s.fitted_to([10_001], 3).gpu_memory_budget == 122_880  # one chunk: 120,012 B aligned
    (tmp_path / "run" / "rank00000").mkdir(parents=True)
    (tmp_path / "run" / "rank00000" / "manifest").write_text("chunk 1000\n")
    assert s.fitted_to([10_001], 3).gpu_memory_budget == 10 * 12_288 + 4_096


def test_an_auto_gpu_budget_is_measured_by_the_first_step_on_a_fresh_run(monkeypatch, tmp_path):
    """Without a "reserve", a budget of "auto" on fresh directories waits for the first step
    (``measures_gpu_budget``), which sizes it from what the first iteration took: free now,
    less what its peak took beyond what torch still holds, less the margin. A run held in
    the directories is resumed with the budget its GPU's states take (``held_gpu_budget``:
    one copy of its states file), measured or not; with a "reserve" it is sized at once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    block = {"devices": [str(tmp_path / "run")], "gpu": {"memory_budget": "auto"}}
    fresh = sds.Settings.from_config({"smartinf": block})
    assert fresh.measures_gpu_budget(0)
    assert not sds.Settings.from_config({"smartinf": dict(block, gpu={
        "memory_budget": "auto", "reserve": "4GiB"})}).measures_gpu_budget(0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 22 << 30)
    measured = gpu_budget.measured()
    assert measured == (50 << 30) - (8 << 30) - int((80 << 30) * gpu_budget.defaults.GPU_MARGIN_SHARE)
    assert fresh.with_gpu_budget(10 << 30, 0, measured).gpu_memory_budget == measured
    assert gpu_budget.measured(margin=60 << 30) == 0
    # a 40 GiB GPU emulated on this 80 GiB one (the rest held by a tensor: in "free"
    # already): the margin is the smaller GPU's
    monkeypatch.setenv("SMARTINF_GPU_MEMORY", "40GiB")
    assert gpu_budget.measured() == (50 << 30) - (8 << 30) - int((40 << 30) * gpu_budget.defaults.GPU_MARGIN_SHARE)
    monkeypatch.setenv("SMARTINF_GPU_MEMORY", "120GiB")  # (more than the GPU: its own)
    assert gpu_budget.measured() == measured
    monkeypatch.delenv("SMARTINF_GPU_MEMORY")
    # a run in the directories: its GPU's states (a cpu device's directory stands in) are
    # resumed with the budget they take, one copy of its states file
    rank = tmp_path / "run" / "rank00000"
    with smartinf.Pipeline(str(rank / "gpu"), smartinf.AdamW(), chunk=1024) as p:
        p.add_subgroup(3000, init=torch.zeros(3000))
    (rank / "manifest").write_text((rank / "gpu" / "manifest").read_text())  # the run's
    size = (rank / "gpu" / "states.bin").stat().st_size
    held = sds_config.held_gpu_budget(str(rank / "gpu"))
    assert held == size // 2 and held >= 3000 * 12
    assert not fresh.measures_gpu_budget(0)
    assert fresh.with_gpu_budget(10 << 30, 0).gpu_memory_budget == held
    overwrite = sds.Settings.from_config({"smartinf": dict(block, if_exists="overwrite")})
    assert overwrite.measures_gpu_budget(0)
    assert sds_config.held_gpu_budget(str(tmp_path / "none")) is None


def test_host_states_move_the_memory_tier_onto_the_gpu(monkeypatch):
    """"gpu": {"host_states": true}: the bytes the memory_budget holds on each directory go to
    the GPU's device for states in host memory (CudaDevice(memory="host"), in front of the
    directories, which keep none); with a GPU budget too, after it. Refused clearly without
    a GPU or without a memory budget to move."""
    from smartinf import CudaDevice
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a", "/b"], "memory_budget": "3GiB",
                                               "gpu": {"host_states": True}}})
    assert s.gpu_host_states and s.gpu_memory_budget == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is visible here"):
        s.with_host_states_on_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    moved = s.with_host_states_on_gpu()
    assert moved.gpu_host_budget == 6 << 30 and moved.pipeline.memory_budget == 0
    assert moved.with_host_states_on_gpu() is moved
    devices = moved.rank_devices(1, 0)
    assert isinstance(devices[0], CudaDevice) and devices[0].memory == "host"
    assert devices[0].memory_budget == 6 << 30 and devices[0].path == "/a/rank00001/gpu-host"
    assert devices[1:] == ["/a/rank00001", "/b/rank00001"]
    both = sds.Settings.from_config({"smartinf": {"devices": ["/a"], "memory_budget": "1GiB", "gpu": {
        "memory_budget": "2GiB", "host_states": True}}}).with_host_states_on_gpu()
    assert [(d.memory, d.memory_budget) for d in both.rank_devices(0, 0)[:2]] == \
        [("gpu", 2 << 30), ("host", 1 << 30)]
    with pytest.raises(ValueError, match="there is no memory_budget"):
        sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {
            "host_states": True}}}).with_host_states_on_gpu()
    for wrong in ("yes", 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="a share from 0 to 1"):
            sds.Settings.from_config({"smartinf": {"devices": ["/a"], "gpu": {"host_states": wrong}}})


def test_a_share_of_the_host_states_on_the_gpu_leaves_the_rest_to_the_cores(monkeypatch):
    """"gpu": {"host_states": 0.75}: three quarters of the memory tier's bytes go to the GPU's
    device for states in host memory, the directories keep the rest (the sub-groups placed
    first go to the GPU, and both update theirs at once); a fitted budget keeps the shares;
    the overlap's host copies are weighed for the cores' part only. Refused without a GPU."""
    s = sds.Settings.from_config({"smartinf": {"devices": ["/a", "/b"], "memory_budget": "2GiB",
                                               "gpu": {"host_states": 0.75}}})
    assert s.gpu_host_states == 0.75
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="host_states=0.75 updates .* no CUDA GPU is visible"):
        s.with_host_states_on_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    shared = s.with_host_states_on_gpu()
    assert shared.gpu_host_budget == 3 << 30 and shared.pipeline.memory_budget == 1 << 29
    devices = shared.rank_devices(0, 0)
    assert (devices[0].memory, devices[0].memory_budget) == ("host", 3 << 30)
    assert devices[1:] == ["/a/rank00000", "/b/rank00000"]
    # fitted (a GPU budget of "auto" sized): what is kept, shared as given
    from smartinf.planning import space
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    mib = 1 << 20
    sized = dataclasses.replace(shared, gpu_memory_budget=24 * mib, gpu_sized=True,
                                pipeline=dataclasses.replace(shared.pipeline, chunk=1 << 20))
    fitted = sized.fitted_to([2 << 20] * 5, 3)  # 24 MiB each: one on the GPU, 96 MiB left
    assert fitted.gpu_host_budget == 144 * mib and fitted.pipeline.memory_budget == 24 * mib
    copies = sds_config._partition_copies
    assert copies(0.75, True, lambda on_gpu: True) == 0.5  # the cores' quarter, two copies
    assert copies(0.0, True, lambda on_gpu: True) == 2 and copies(1.0, True, lambda on_gpu: True) == 0


def test_host_states_on_the_gpu_by_default_where_faster(tmp_path, monkeypatch):
    """With a "gpu" block "host_states" is "auto": without a probe record the GPU takes int8
    and int4 moments (a few bytes a param each way over PCIe), the host's cores fp32 ones;
    with a record, whichever rate is higher: the link's over the states' bytes or the
    cores' kernel. Nothing moves without a GPU, or without a memory budget."""
    from smartinf.planning import host_states, model, placement

    def block(state_dtype, **gpu):
        return sds.Settings.from_config({"smartinf": {
            "devices": [str(tmp_path)], "memory_budget": "1GiB", "state_dtype": state_dtype,
            "gpu": {"memory_budget": "1GiB", **gpu}}})
    assert block("int8").gpu_host_states == "auto"
    assert sds.Settings.from_config({"smartinf": {"devices": ["/a"]}}).gpu_host_states is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert block("int8").with_host_states_on_gpu().gpu_host_budget == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert block("int8").with_host_states_on_gpu().gpu_host_budget == 1 << 30
    assert block("int4").with_host_states_on_gpu().gpu_host_budget == 1 << 30
    fp32 = block("fp32").with_host_states_on_gpu()
    assert fp32.gpu_host_budget == 0 and fp32.pipeline.memory_budget == 1 << 30
    # a run made with them on the GPU resumes with them there (its sub-groups are in gpu-host/)
    held = tmp_path / "rank00001" / "gpu-host"
    held.mkdir(parents=True)
    (held / "manifest").write_text("")
    assert block("fp32").with_host_states_on_gpu(rank=1).gpu_host_budget == 1 << 30
    assert block("fp32").with_host_states_on_gpu(rank=0).gpu_host_budget == 0
    # and one made with them on the cores (before host states existed) keeps them there:
    # a GPU device added to its directories would be refused
    (tmp_path / "rank00002").mkdir()
    (tmp_path / "rank00002" / "manifest").write_text("")
    assert block("int8").with_host_states_on_gpu(rank=2).gpu_host_budget == 0
    assert block("int8", host_states=True).with_host_states_on_gpu(rank=2).gpu_host_budget == 1 << 30
    assert block("fp32", host_states=True).with_host_states_on_gpu().gpu_host_budget == 1 << 30
    assert block("int8", host_states=False).with_host_states_on_gpu().gpu_host_budget == 0
    # The lent H100 host's probe record: 55 GB/s each way alone, 78 % of it at once, over
    # fp32's 12 B a param: 3.57 G params/s against the cores' 4.94; int8 + split's 4.03 B
    # a param: 10.64 against 4.36
    record = Path(__file__).parent.parent / "bench" / "measured" / "h100-probe-record.json"
    monkeypatch.setattr(host_states, "find_record", lambda d: str(record))
    takes, why = host_states.gpu_takes_host_states("fp32", "fp32", "/a")
    assert not takes and "the host's cores 4.94 G params/s" in why
    takes, why = host_states.gpu_takes_host_states("int8", "split", "/a")
    assert takes and "10.64 G params/s (42.9 GB/s each way" in why
    # Shared (both at once, the link carrying the cores' gradients and params too), the
    # model's best: more than either alone can give
    assert "share best at host_states=0.70: 0.080 s a G params, 0.094 s on the GPU alone, " \
           "0.229 s on the cores alone" in why
    assert "host_states=0.45: 0.152 s a G params, 0.280 s on the GPU alone, 0.270 s on the " \
           "cores alone" in host_states.gpu_takes_host_states("fp32", "fp32", "/a")[1]
    figures = json.loads(record.read_text())
    rates = placement.recorded_rates(figures.get("figures", figures), "int4", "split")
    state = model.state_bytes_per_param("int4", "split")
    times = [host_states.shared_update_s(rates, state, i / 20) for i in range(21)]
    assert host_states.best_share(rates, state) == 0.75 == times.index(min(times)) / 20


def test_auto_weighs_the_host_copies_the_overlap_allocates():
    """auto weighs the host copies of the partitions the overlap allocates: params out, and
    on a GPU gradients in, where updates start during backward; none where the GPU updates
    its states from host memory, in place: gradients where they are, params into the
    partitions, in its memory or, with offload_param, the host's."""
    copies = sds_config._partition_copies
    overlap, no_overlap = (lambda on_gpu: True), (lambda on_gpu: False)
    assert copies(False, True, overlap) == 2 and copies(False, False, overlap) == 1
    assert copies("auto", True, overlap) == copies(True, True, overlap) == 0
    assert copies("auto", False, overlap) == 1  # ("auto" without a GPU: the cores)
    assert copies(False, True, no_overlap) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gpu_norms_are_deepspeeds_to_the_order_of_additions(dtype):
    """A sub-group's sum of squared gradient norms on a GPU (deepspeed_norm.square_sum:
    torch's multi-tensor norm, adding in fp64 as it reads) against DeepSpeed's ops (each
    gradient copied into fp64, then its norm), on views of one flat buffer as ZeRO-3's
    partitions are (odd offsets and lengths, an empty one). The squares are exact in fp64, so
    the two differ only in the order of their additions: within 2 (n + k + 1) units of fp64
    rounding of the sum (n elements, k tensors), where adding in fp32 would be ~1e-7 off. An
    inf or a NaN gives the same inf or NaN (the sub-group's -1)."""
    from smartinf.integrations.deepspeed_norm import square_sum
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = (torch.randn(3_000_017, generator=g, device="cuda") * 1e-2).to(dtype)
    bounds = [0, 3, 3, 1_000_003, 1_000_004, 2_999_999, 3_000_017]
    grads = [flat[a:b] for a, b in zip(bounds, bounds[1:])]

    def both() -> tuple:
        theirs = torch.sum(torch.pow(torch.stack([t.to(torch.float64).norm(2.0) for t in grads]), 2.0))
        return square_sum(grads, torch.float64, "cuda"), theirs

    ours, theirs = both()
    assert ours.dtype == torch.float64 and theirs.item() > 0
    bound = 2 * (flat.numel() + len(grads) + 1) * 2.0**-53 * theirs.item()
    assert abs(ours - theirs).item() <= bound, (ours.item(), theirs.item(), bound)
    for bad, same in ((float("inf"), torch.isposinf), (float("nan"), torch.isnan)):
        flat[1_500_000] = bad
        assert all(bool(same(x)) for x in both()), bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a CUDA GPU")
def test_pinned_blocks_torch_keeps_cached_are_given_back_before_a_choice():
    """A page-locked block freed into torch's cache (as ZeRO-3's offload_param frees each
    param's partition once it has moved them into flat buffers) counts as available host
    memory once the choice's release has run: here 4 GiB of it."""
    block = torch.empty(4 << 30, dtype=torch.uint8).pin_memory()
    block.fill_(1)
    del block  # (still page-locked, in torch's cache)
    before = space.available_memory()
    sds_config.release_cached_pinned()
    assert space.available_memory() - before > 3 << 30


def test_the_examples_gpu_memory_emulation_is_refused_where_it_cannot_hold(work, disk_dir):
    """--gpu-memory emulates a smaller GPU on a larger one: without a GPU (or for more than
    the GPU has) the example says so before it makes anything, rather than run unemulated."""
    if torch.cuda.is_available():
        pytest.skip("the refusal without a GPU")
    storage = f"{disk_dir}/emulated"
    train(work, storage, "emulated", extra=("--gpu-memory", "80GiB"),
          fails_with="--gpu-memory emulates a smaller GPU on a CUDA GPU: there is none here")
    assert not os.path.exists(storage)


def test_ranks_of_one_host_are_refused_the_host_memory_they_exceed_together(work, disk_dir):
    """Two ranks of this host each given a memory budget it would be given alone, which
    together exceed the host's available memory, are refused at the first step before
    either holds it, naming both (each rank's own check passed them: four ranks at the
    65B shape were killed for host memory), on every rank alike."""
    budget = int(space.available_memory() * 0.7)
    train(work, f"{disk_dir}/together", "together", world=2, extra=("--memory-budget", str(budget)),
          fails_with="and 2 ranks of this host open as much at once")


def test_deepspeeds_throughput_timer_leaves_the_gpus_updates_running(caplog):
    """DeepSpeed's throughput timer synchronizes the whole device at each forward's start and
    each step's end by default, which would wait for the updates a GPU finishes on its own
    streams while the next forward runs: initialize turns it off unless the config sets it
    (true is kept, with a warning), and changes no config in place."""
    unsynchronized = sds_config._with_unsynchronized_timer
    assert unsynchronized({})["timers"] == {"throughput": {"synchronized": False}}
    given = {"timers": {"throughput": {"enabled": False}}, "train_batch_size": 8}
    assert unsynchronized(given) == {"timers": {"throughput": {"enabled": False, "synchronized": False}},
                                     "train_batch_size": 8}
    assert given == {"timers": {"throughput": {"enabled": False}}, "train_batch_size": 8}
    kept = {"timers": {"throughput": {"synchronized": True}}}
    with caplog.at_level("WARNING", logger="smartinf"):
        assert unsynchronized(kept) is kept
        assert "none finishes while the next forward runs" in caplog.text
    off = {"timers": {"throughput": {"synchronized": False}}}
    assert unsynchronized(off) is off


def test_every_setting_reaches_the_pipeline_from_every_entry_point(tmp_path):
    """One PipelineSettings, checked in one place, from the DeepSpeed block,
    smartinf.optim's keywords and Pipeline's."""
    import smartinf
    import smartinf.optim
    given = {"slots": 2, "chunk": 4096, "io": "threads", "queue_depth": 8, "host_link_gbps": 1.5,
             "verify": True, "state_dtype": "int8", "if_exists": "overwrite", "master": "split",
             "io_schedule": "phased", "memory_budget": 1 << 20, "commit_every": 3, "copies": 2}
    block = sds.Settings.from_config({"smartinf": {"devices": ["/a"], **given}}).pipeline
    opt = smartinf.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))],
                               devices=[str(tmp_path / "o")], **given)
    pipe = smartinf.Pipeline(str(tmp_path / "p"), **given)
    assert block == opt.pipeline.settings == pipe.settings == smartinf.PipelineSettings.resolve(**given)
    assert [c.schedule for c in opt.pipeline.io_schedules + pipe.io_schedules] == ["phased"] * 2
    opt.close()
    pipe.close()
    with pytest.raises(TypeError, match="not both"):  # keywords beside settings= are not dropped
        smartinf.Pipeline(str(tmp_path / "q"), settings=block, slots=3)
    with pytest.raises(ValueError, match='"smartinf" config block: queue_depth=0'):
        sds.Settings.from_config({"smartinf": {"devices": ["/a"], "queue_depth": 0}})


@pytest.mark.parametrize("make, rule", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), "adamw"),
    (lambda p: torch.optim.Adam(p, lr=1e-3), "adam"),
    (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), "sgd"),
    (lambda p: torch.optim.Adagrad(p, lr=1e-3), "adagrad"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True), "adamw_amsgrad"),
    (lambda p: sds.LionParams(p, lr=1e-3), "lion"),
    (lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, maximize=True), "adam_amsgrad"),
    (lambda p: torch.optim.SGD(p, lr=1e-3, maximize=True), "sgd"),
    (lambda p: torch.optim.Adagrad(p, lr=1e-3, maximize=True), "adagrad"),
    (lambda p: sds.LionParams(p, lr=1e-3, maximize=True), "lion"),
])
def test_base_optimizer_maps_to_its_update_rule(make, rule):
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    got = sds_config._rule(sds_config._rule_class(opt), opt.param_groups[0])
    assert got.name == rule and got.lr == 1e-3
    assert got.maximize == opt.param_groups[0]["maximize"]


def test_a_config_lion_block_is_checked_before_anything_is_built():
    """Its options become LionParams's arguments: an unknown one is named, not a TypeError."""
    model = torch.nn.Linear(2, 2)
    config = {**BASE, "optimizer": {"type": "Lion", "params": {"lr": 1e-3, "set_grad_none": True}}}
    with pytest.raises(ValueError, match=r"\['set_grad_none'\] of the Lion block"):
        sds.initialize(model=model, model_parameters=model.parameters(), config=config)


def test_unsupported_base_optimizers_and_options_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="RMSprop"):
        sds_config._rule_class(torch.optim.RMSprop(p))
    with pytest.raises(ValueError, match="bias_correction"):
        sds_config._rule(sds_config._rule_class(torch.optim.AdamW(p)), {"lr": 1e-3, "bias_correction": False})


# -- the block takes effect wherever deepspeed.initialize is called -------------------------
HOOK_SCRIPT = r"""
import os, sys
import deepspeed, torch
assert hasattr(deepspeed.initialize, "__wrapped__")  # no smartinf import: the .pth hooked it
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "smartinf": {"devices": [sys.argv[1]]}}
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
print("engine", type(engine).__name__)
import smartinf.integrations.deepspeed as sds, smartinf.optim
deepspeed.initialize = sds.initialize  # by hand, as users did: no recursion
engine, *_ = deepspeed.initialize(model=torch.nn.Linear(8, 8), config=dict(
    config, smartinf={"devices": [sys.argv[1] + "-2"]}), model_parameters=model.parameters())
print("by hand", type(engine).__name__)
opt = smartinf.optim.AdamW(model.parameters(), devices=[sys.argv[1] + "-3"])
try:
    deepspeed.initialize(model=model, optimizer=opt, config={k: v for k, v in config.items()
                                                              if k not in ("smartinf", "optimizer")})
except ValueError as e:
    print("refused:", e)
"""


def test_the_smartinf_block_needs_no_smartinf_code(tmp_path):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, "-c", HOOK_SCRIPT, str(tmp_path / "states")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "engine SmartInfEngine" in done.stdout and "by hand SmartInfEngine" in done.stdout
    assert "refused: a smartinf.optim.AdamW was given to DeepSpeed" in done.stdout
    assert (tmp_path / "states" / "rank00000" / "manifest").is_file()
    off = subprocess.run([sys.executable, "-c", "import deepspeed, sys; "
                          "print(hasattr(deepspeed.initialize, '__wrapped__'))"],
                         env=dict(env, SMARTINF_AUTOLOAD="0"), capture_output=True, text=True)
    assert off.stdout.strip().endswith("False")  # the documented switch turns it off


# -- edits between steps, kept-whole params right after step() (tests/deepspeed_edits.py) --
BF16_ULP = 2.0 ** -7  # one bf16 ulp is at most this much of the value it is next to
EDIT_CASES = {  # name: (world, overlap, script flags, tolerance)
    "1-serial": (1, False, (), TOL), "1-overlap": (1, True, (), TOL),
    "2-serial": (2, False, (), TOL), "2-overlap": (2, True, (), TOL),
    # resident states, durable every 2 steps (twins, background commits)
    "2-overlap-resident": (2, True, ("--block", '{"memory_budget": "64MiB", "commit_every": 2}'), TOL),
    # bf16 with a split master: an edit its low half still rounds back to keeps those low
    # bits (within half an ulp of the edit, where DeepSpeed told takes the edit): every
    # element within one bf16 ulp of DeepSpeed's
    "2-overlap-bf16-split": (2, True, ("--bf16", "--block", '{"master": "split"}'), BF16_ULP),
    # with frozen kept-whole params (in no sub-group: their partitions take the edits)
    "2-overlap-bf16-split-frozen": (2, True, ("--bf16", "--freeze", "--block", '{"master": "split"}'),
                                    BF16_ULP),
    # and at one rank, where the kept-whole params' gathered copies are their partitions:
    # their edits are the devices' to tell
    "1-overlap-bf16-split": (1, True, ("--bf16", "--block", '{"master": "split"}'), BF16_ULP),
    # (a CUDA GPU only) the same, states resident in the GPU's memory: its sub-groups' params
    # read, checksummed and written in their partitions there
    "1-overlap-bf16-split-gpu": (1, True, ("--bf16", "--block", '{"master": "split", "gpu": '
                                                              '{"memory_budget": "64MiB"}}'), BF16_ULP),
    # and with a GPU budget too small for the largest sub-group: it goes through the host
    # buffers, whose params cross only when the partition was edited
    "1-overlap-bf16-split-gpu-host": (1, True, ("--bf16", "--block", '{"master": "split", "gpu": '
                                                                   '{"memory_budget": "128KiB"}}'),
                                      BF16_ULP),
    # and with the memory tier's states in host memory, updated on the GPU across PCIe
    # (their partitions' params read, checksummed and written in place as above)
    "1-overlap-bf16-split-gpu-states-in-host": (1, True, ("--bf16", "--block", '{"master": "split", '
                                                          '"memory_budget": "64MiB", "gpu": '
                                                          '{"host_states": true}}'), BF16_ULP),
    # and with a GPU budget of "auto": the first step opens the pipeline, sizing the budget
    # from what the first iteration took (edits before it are the model's own params)
    "1-overlap-bf16-split-gpu-auto": (1, True, ("--bf16", "--block", '{"master": "split", "gpu": '
                                                                   '{"memory_budget": "auto"}}'),
                                      BF16_ULP),
}


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory):
    """A world size's cases, from one torchrun of them all (made on first use, once for all
    of pytest-xdist's workers): its directory, and the launch's output."""
    def get(world: int) -> tuple:
        def make(out: Path) -> None:
            cases = [(name, overlap, flags) for name, (w, overlap, flags, _) in EDIT_CASES.items()
                     if w == world and ("-gpu" not in name or torch.cuda.is_available())]
            done = torchrun(world, ROOT / "tests" / "deepspeed_edits.py", "--dir", str(out),
                            "--out", str(out), "--cases", json.dumps(cases))
            (out / "launch.log").write_text(f"{' '.join(done.args)}:\n{done.stdout[-3000:]}\n"
                                            f"{done.stderr[-6000:]}")
            # the launch ended well, or one of its cases failed (whose test says so)
            assert done.returncode == 0 or not all((out / f"{c[0]}.json").is_file() for c in cases), \
                (out / "launch.log").read_text()
        out = made_once(tmp_path_factory, f"deepspeed-edits-{world}", make)
        return out, (out / "launch.log").read_text()
    return get


@pytest.mark.parametrize("case", EDIT_CASES)
def test_edits_and_kept_whole_params_as_deepspeed_told_of_them(edit_runs, case):
    """Params clamped and rolled back through GatheredParameters(modifier_rank=0) and
    kept-whole params pruned in place become the masters at the next step, as DeepSpeed's
    own ZeRO-3 does once told of them (safe_set_full_fp32_param), and so does a kept-whole
    param's data replaced (``p.data = ...``); the kept-whole params read
    without a gather right after step() are DeepSpeed's, with the step's tail running during
    the next forward (overlap: updates during backward, as on a GPU) or not. At one rank the
    step leaves them gathered (their copies are their partitions): none is released."""
    world, _, _, tol = EDIT_CASES[case]
    if "-gpu" in case and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, launch = edit_runs(world)
    out = folder / f"{case}.json"
    assert out.is_file(), launch
    record = json.loads(out.read_text())
    assert record["kept_whole"] > 0
    for step, s in enumerate(record["steps"], 1):
        assert s["kept_whole_shapes_equal"], f"step {step}: kept-whole params read empty"
        # DeepSpeed's step releases the kept-whole params and gathers them again; at one
        # rank, where the gathered copy is the partition, smartinf's leaves them be: but at
        # the first step (DeepSpeed's first backward, recording its trace, released them),
        # and where their data was replaced by other tensors (then DeepSpeed's, whole)
        ours_released, deepspeeds_released = s["released"]
        assert deepspeeds_released > 0, (step, s)
        if step > 1 and s["edit_before"] != "rescale_kept_whole":
            assert (ours_released == 0) == (world == 1), (step, s)
        assert s["kept_whole"] <= tol and s["gathered"] <= tol, (step, s)
        ours, ref = s["losses"]
        assert abs(ours - ref) <= tol * abs(ref), (step, s)
    assert record["clamped_max"] > 0.5  # rolled back past the clamp (0.05) at step 5
    # a checkpoint's masters hold an edit made after step(): at most the clamp as the
    # params' dtype holds it, and half an ulp above for a split master's low bits
    clip = record["clip_fp32"] if tol == TOL else record["clip_bf16"] * (1 + BF16_ULP / 2)
    assert record["saved_max"] <= clip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_budget_of_auto_is_sized_by_the_first_step_and_changes_no_bit(work, disk_dir):
    """"gpu": {"memory_budget": "auto"} on fresh directories: no pipeline until the first
    step, which sizes the budget from what the first iteration took and opens it; the run is
    bit for bit the one whose states stay on the host (placement changes no bit)."""
    host = train(work, f"{disk_dir}/host", "auto-gpu-host")
    auto = train(work, f"{disk_dir}/auto", "auto-gpu", extra=("--gpu-memory-budget", "auto"))
    assert losses(auto) == losses(host)
    for a, b in zip(auto["params"], host["params"]):
        assert torch.equal(a, b)
    assert "pipeline" in auto["steps"][0]  # opened by the first step, counted from it


@pytest.mark.parametrize("world", [1, 2])
def test_a_model_built_partitioned_trains_as_built_whole(work, disk_dir, world):
    """deepspeed.zero.Init (each param partitioned as it is made, initialised gathered) with
    activation checkpointing: bit for bit the losses and params of the model built whole."""
    whole, parts = train_all(work, world, Run(f"{disk_dir}/whole", f"whole-{world}"),
                             Run(f"{disk_dir}/parts", f"parts-{world}",
                                 ("--zero-init", "--checkpoint-activations")))
    assert losses(parts) == losses(whole)
    for a, b in zip(parts["params"], whole["params"]):
        assert torch.equal(a, b)


PLANNED = {"SMARTINF_MEMORY_BUDGET": "", "SMARTINF_COMMIT_EVERY": ""}  # (launch_env's cleared)


@pytest.mark.parametrize("world", [1, 2])
def test_auto_chooses_once_for_every_rank_and_trains_as_chosen(work, disk_dir, world):
    """"state_dtype": "auto", and a block with only "devices": rank 0 picks (plan.choose: this
    tiny model's states all fit in memory, so fp32 states resident with a commit every 10
    steps), every rank runs it, and the run is bit for bit the one with fp32 states streamed
    (the tiers change no bit)."""
    auto, defaults, plain = train_all(
        work, world, Run(f"{disk_dir}/auto-{world}", f"auto-{world}", ("--state-dtype", "auto"), env=PLANNED),
        Run(f"{disk_dir}/defaults-{world}", f"defaults-{world}", env=PLANNED),
        Run(f"{disk_dir}/plain-{world}", f"plain-{world}"))
    for run in (auto, defaults):
        said = [line for line in run["log"].splitlines() if "smartinf auto:" in line]
        assert len(said) == 1 and "state_dtype='fp32'" in said[0] and "commit_every=10" in said[0]
        assert losses(run) == losses(plain)
        for a, b in zip(run["params"], plain["params"]):
            assert torch.equal(a, b)
    assert defaults["smartinf"] == {"devices": [f"{disk_dir}/defaults-{world}/smartinf"],
                                    "if_exists": "error"}  # (the example's block: devices only)


def test_ranks_of_one_copy_at_different_steps_are_refused(work, disk_dir):
    """One copy holds no earlier step: a rank a commit ahead of the other (here made so: rank
    1's directory put back as it was a commit before) cannot go back, and the run says so."""
    one = ("--memory-budget", "8MiB", "--commit-every", "2", "--copies", "1")
    storage = f"{disk_dir}/one-apart"
    train(work, storage, "one-apart-first", world=2, extra=(*one, "--steps", "2"))
    rank1 = Path(storage) / "smartinf" / "rank00001"
    shutil.copytree(rank1, f"{rank1}.at2")
    train(work, storage, "one-apart-second", world=2, extra=(*one, "--steps", "2", "--if-exists", "resume"))
    shutil.rmtree(rank1)
    shutil.move(f"{rank1}.at2", rank1)
    train(work, storage, "one-apart-third", world=2, extra=(*one, "--if-exists", "resume"),
          fails_with="(rank 0: step 4, rank 1: step 2), of one copy (copies=1)")


def test_a_rank_one_commit_ahead_goes_back_to_the_others_step(work, disk_dir):
    """A crash between the ranks' commits leaves one rank's directories a commit ahead (here
    made so: rank 1's rolled back one commit by hand). Reopened, that rank goes back to the
    others' step (its shadow copies hold it), and the run continues bit for bit as one that
    stopped at that step; pipelines refuse to go back further than they hold."""
    import smartinf
    crashed, stopped = f"{disk_dir}/crashed", f"{disk_dir}/stopped"
    train(work, crashed, "ahead-first", world=2, extra=("--steps", "3"))
    rank1 = Path(crashed) / "smartinf" / "rank00001"
    with smartinf.Pipeline(str(rank1), smartinf.AdamW()) as pipe:
        assert (pipe.durable_step_count, pipe.previous_step_count) == (3, 2)
        with pytest.raises(ValueError, match="cannot go back to step 1: these directories are at step 3"):
            pipe.roll_back_to(1)
        pipe.roll_back_to(2)
    out = work / "ahead-resumed"
    done = torchrun(2, SCRIPT, "--mode", "smartinf", "--dir", crashed, "--steps", "2",
                    "--json", f"{out}.json", "--params-out", f"{out}.pt", "--if-exists", "resume")
    assert done.returncode == 0, done.stderr[-6000:]
    assert "rank 0's directories" in done.stderr and "rolled back to step 2" in done.stderr
    _, ref = train_all(work, 2, Run(stopped, "stopped-first", ("--steps", "2")),
                       Run(stopped, "stopped-resumed", ("--steps", "2", "--if-exists", "resume")))
    resumed = json.loads(Path(f"{out}.json").read_text())
    assert losses(resumed) == losses(ref)
    for a, b in zip(torch.load(f"{out}.pt"), ref["params"]):
        assert torch.equal(a, b)


def killed_at_random(work: Path, storage: str, rng, extra: tuple) -> None:
    """Two ranks training with ``extra`` until SIGKILL ends the launcher and both ranks at a
    random moment after a random step (3-6): mid-step, mid-commit, mid-write."""
    import signal
    import time

    import psutil
    run = warm.start("deepspeed", WARM, [SCRIPT, "--mode", "smartinf", "--dir", storage,
                                         "--steps", "60", *extra],
                     world=2, env=launch_env(2), port=free_port())
    after, seen = rng.randint(3, 6), []
    try:
        for line in run.lines():
            seen.append(line)
            if line.startswith(f"step {after:4d}"):
                time.sleep(rng.uniform(0.0, 0.5))
                break
        else:
            pytest.fail("the run ended before it was killed:\n" + "".join(seen[-40:]) +
                        run.stderr()[-4000:])
    finally:
        try:
            launcher = psutil.Process(run.pid)
            procs = [launcher] + launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        run.close()
        # The ranks are the launcher's children: their directories' locks are free only once
        # the kernel has torn them down (dead, or a zombie nobody reaps), which a kill does
        # not wait for.
        deadline = time.monotonic() + 60
        while any(_running(p) for p in procs):
            assert time.monotonic() < deadline, f"still running after SIGKILL: {procs}"
            time.sleep(0.05)


def _reopened(directory: str, **kwargs):
    """The directory opened once its killed owner's lock is free: a killed process's files
    are released when its in-flight io_uring requests have finished, after it is a zombie."""
    import errno
    import time

    import smartinf
    deadline = time.monotonic() + 120
    while True:
        try:
            return smartinf.Pipeline(directory, smartinf.AdamW(), if_exists="resume", **kwargs)
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _running(proc) -> bool:
    import psutil
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_ranks_decide_together_whether_a_logged_step_is_finished():
    """Every rank seals its step's log before any updates: a rank a step ahead means all had
    sealed (finish); all sealed at one step (finish); one lacking it means none updated
    (drop); a rank ahead of one without a log, or two steps apart, does not fit one run."""
    from smartinf.integrations.deepspeed_states import logged_step_decision as decide
    assert decide([5, 5], [True, True]) == "finish"
    assert decide([5, 6], [True, False]) == "finish"
    assert decide([5, 5], [True, False]) == "drop"
    assert decide([5, 5], [False, False]) == "drop"
    assert decide([5, 6], [False, False]) == "apart"
    assert decide([5, 7], [True, False]) == "apart"
    assert decide([5, 5, 6], [True, True, False]) == "finish"
    assert decide([5, 5, 6], [True, False, False]) == "apart"


def resumes_as_stopped(work: Path, disk_dir: str, killed: str, trial: int, extra: tuple,
                       step: int) -> None:
    """The killed run resumed for 3 steps trains bit for bit as one stopped at ``step`` and
    resumed."""
    resume = ("--if-exists", "resume", "--steps", "3")
    stopped = os.path.join(disk_dir, "stopped")
    resumed, _, ref = train_all(work, 2, Run(killed, f"killed-resumed-{trial}", extra + resume),
                                Run(stopped, f"stopped-{trial}", extra + ("--steps", str(step))),
                                Run(stopped, f"stopped-resumed-{trial}", extra + resume))
    assert losses(resumed) == losses(ref)
    for a, b in zip(resumed["params"], ref["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("trial", range(3))
def test_two_ranks_with_a_log_killed_at_random_resume_at_one_step(work, disk_dir, trial):
    """copies="log": each rank logs and seals its step's gradients, and waits for the other
    before updating. Both ranks killed at a random moment: the next run finishes the logged
    step on every rank (where one rank is a step ahead, or both hold its log) or forgets it
    (where one lacks it: no rank had updated), and trains bit for bit as a run that stopped
    at that step."""
    import random
    extra = ("--copies", "log", "--no-overlap", "--compute-threads", "1")
    killed = os.path.join(disk_dir, "killed")
    killed_at_random(work, killed, random.Random(20261127 + trial), extra)
    durable, pending = [], []
    for rank in range(2):
        with _reopened(os.path.join(killed, "smartinf", f"rank{rank:05d}"), copies="log",
                       defer_logged_step=True) as pipe:  # (looked at, not finished)
            durable.append(pipe.durable_step_count)
            pending.append(pipe.logged_step_pending)
    low = min(durable)
    step = low + 1 if max(durable) > low or all(pending) else low
    print(f"\nkilled with a log: durable steps {durable}, logs pending {pending}: resumed at {step}")
    assert max(durable) - low <= 1, durable
    if max(durable) > low:  # a rank a step ahead had updated: the one behind sealed its log
        assert all(p for d, p in zip(durable, pending) if d == low), (durable, pending)
    resumes_as_stopped(work, disk_dir, killed, trial, extra, step)


@pytest.mark.parametrize("trial", range(2))
def test_two_ranks_killed_at_random_resume_at_one_durable_step(work, disk_dir, trial):
    """All states resident with twins, a commit every 2 steps written in the background:
    both ranks killed at a random moment. Each rank's directories are at a commit (at most
    one apart); the next run resumes every rank at the same one and trains bit for bit as a
    run that stopped there."""
    import random
    extra = ("--memory-budget", "8MiB", "--commit-every", "2", "--compute-threads", "1")
    killed = os.path.join(disk_dir, "killed")
    killed_at_random(work, killed, random.Random(20261126 + trial), extra)
    durable = []
    for rank in range(2):
        with _reopened(os.path.join(killed, "smartinf", f"rank{rank:05d}")) as pipe:
            durable.append(pipe.durable_step_count)
    assert all(d % 2 == 0 for d in durable) and abs(durable[0] - durable[1]) <= 2, durable
    step = min(durable)
    resumes_as_stopped(work, disk_dir, killed, trial, extra, step)


def test_two_ranks_on_one_drive_take_its_turns(work, disk_dir):
    """Phased I/O (SMARTINF_IO_SCHEDULE=phased) with two ranks' directories on one drive:
    their rings take the drive's turns across the two processes (pipeline/host_turns.h),
    while the ranks also wait for each other in DeepSpeed's collectives; the run finishes,
    with the losses and params of mixed I/O, bit for bit."""
    mixed, phased = train_all(work, 2, Run(f"{disk_dir}/mixed", "mixed-2"),
                              Run(f"{disk_dir}/phased", "phased-2",
                                  env={"SMARTINF_IO_SCHEDULE": "phased"}))
    assert all(s.startswith("phased") for s in phased["choices"]["io_schedules"])
    assert sum(s["pipeline"]["io_turns"] for s in phased["steps"]) > 0
    assert losses(phased) == losses(mixed)
    assert params_rel_diff(phased, mixed) == 0


def test_the_examples_batches_made_ahead_are_the_streams():
    """examples/gpt/data.py's made_ahead (the DeepSpeed and FSDP examples' data): the batches
    made before the loop, then those made as read past its cap, are ``batches``' stream in
    order, so a run's losses and a resumed run's (which skips the batches its checkpoint
    consumed) are what they were."""
    import itertools
    sys.path.insert(0, str(ROOT))
    from examples.gpt.data import Language, batches, made_ahead
    lang = Language()
    ahead = list(itertools.islice(made_ahead(lang, 2, 16, 5, 4, torch.device("cpu"), most=3), 7))
    stream = list(itertools.islice(batches(lang, 2, 16, 5), 7))
    assert len(ahead) == 7
    for (x, y), (want_x, want_y) in zip(ahead, stream):
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
