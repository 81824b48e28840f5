"""Raw storage bandwidth, then the Pipeline step measured against it.

The storage limit of a step is ``bytes_read / read_bw + bytes_written / write_bw`` with
the bandwidths measured by ``test_storage_*`` on the same directory in the same run; the
goal is ``step / limit <= 1.10`` (compute and host copies hidden under storage time).
"""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch

import smartinf
import smartinf._native as native
from conftest import env_int, require_disk

SUBGROUP = 16 << 20  # params per sub-group
ROUNDS = env_int("SMARTINF_BENCH_ROUNDS", 3)
STEP_PARAMS = env_int("SMARTINF_BENCH_PARAMS", 256 << 20)
ENGINE_PARAMS = env_int("SMARTINF_BENCH_ENGINE_PARAMS", 64 << 20)
SLOTS = [int(s) for s in os.environ.get("SMARTINF_BENCH_SLOTS", "4").split(",") if s.strip()]
STATE_BYTES = 24  # per param on disk: two shadow copies of param32 + exp_avg + exp_avg_sq
F32, F16 = 0, 1   # kernels::DType codes (smartinf.pipeline.buffers)


def test_storage_write(benchmark, storage_limits):
    require_disk(storage_limits.directory, storage_limits.nbytes, "the write bandwidth test")
    seconds: list[float] = []
    benchmark.pedantic(lambda: seconds.append(storage_limits.time(True)), rounds=ROUNDS,
                       iterations=1)
    bw = storage_limits.record("write", seconds)
    benchmark.extra_info.update(bytes=storage_limits.nbytes, write_bytes_per_s=bw,
                                rounds_bytes_per_s=[storage_limits.nbytes / s for s in seconds])


def test_storage_read(benchmark, storage_limits):
    require_disk(storage_limits.directory, storage_limits.nbytes, "the read bandwidth test")
    # Each round reads a freshly written file, as a step reads the copy the step before
    # wrote. On the 2-core VM disk the first read after a write ran at ~2.7 GB/s, later
    # re-reads of the same file at 1.0-2.0 GB/s; the faster figure is the stricter limit.
    def write_fresh_file() -> None:
        storage_limits.time(True)

    seconds: list[float] = []
    benchmark.pedantic(lambda: seconds.append(storage_limits.time(False)), rounds=ROUNDS,
                       iterations=1, setup=write_fresh_file)
    storage_limits.remove()
    bw = storage_limits.record("read", seconds)
    benchmark.extra_info.update(bytes=storage_limits.nbytes, read_bytes_per_s=bw,
                                rounds_bytes_per_s=[storage_limits.nbytes / s for s in seconds])


class StepRunner:
    """A Pipeline over ``params`` zero-initialised params and a ring of 2 grad/out pairs."""

    def __init__(self, directory: str, params: int, slots: int, io: str | None = None,
                 state_dtype: str = "fp32", master: str = "fp32", param_dtype=np.float16,
                 io_schedule: str | None = None, copies: "int | str" = 2) -> None:
        self.directory = directory
        self.params = params
        self.slots = slots
        self.pipe = smartinf.Pipeline(directory, smartinf.AdamW(lr=1e-4), chunk=1 << 20,
                                      slots=slots, io=io, state_dtype=state_dtype, master=master,
                                      io_schedule=io_schedule, copies=copies)
        self.sizes = [min(SUBGROUP, params - i) for i in range(0, params, SUBGROUP)]
        self.sgs = [self.pipe.add_subgroup(n) for n in self.sizes]  # writes the states: not timed
        rng = np.random.default_rng(0)
        self.grads = [rng.standard_normal(SUBGROUP, dtype=np.float32) * 1e-3 for _ in range(2)]
        # A split master is sent the sub-group's own params: one buffer each (the model's).
        count = len(self.sizes) if master == "split" else 2
        self.outs = [torch.zeros(SUBGROUP, dtype=torch.bfloat16) if param_dtype == "bf16"
                     else np.empty(SUBGROUP, param_dtype) for _ in range(count)]
        self.rounds: list[tuple[float, dict]] = []

    def step(self) -> None:
        before = self.pipe.stats
        start = time.perf_counter()
        futures = [None, None]
        with self.pipe.step():
            if self.pipe.logs_gradients:  # copies="log": the step's gradients first
                for i, (sg, n) in enumerate(zip(self.sgs, self.sizes)):
                    self.pipe.update(sg, self.grads[i % 2][:n], self.outs[0][:n], log_only=True)
            for i, (sg, n) in enumerate(zip(self.sgs, self.sizes)):
                k = i % 2
                if futures[k] is not None:
                    futures[k].wait()  # pair k is still read/written by the update before
                out = self.outs[i if len(self.outs) > 2 else k]
                futures[k] = self.pipe.update(sg, self.grads[k][:n], out[:n])
        elapsed = time.perf_counter() - start
        after = self.pipe.stats
        self.rounds.append((elapsed, {k: after[k] - before.get(k, 0) for k in after}))

    def close(self) -> None:
        self.pipe.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def measure_steps(benchmark, runner, storage_limits, setup=None) -> dict:
    """Times ``ROUNDS`` steps of ``runner`` (after a warmup) and derives the ratios."""
    read_bw, write_bw = storage_limits.read_bw, storage_limits.write_bw
    benchmark.pedantic(runner.step, rounds=ROUNDS, iterations=1, warmup_rounds=1, setup=setup)
    params = runner.params
    timed = runner.rounds[-ROUNDS:]  # drop the warmup round
    step_s, delta = sorted(timed, key=lambda r: r[0])[len(timed) // 2]  # the median round
    limit_s = delta["storage_read"] / read_bw + delta["storage_write"] / write_bw
    busy = {k: v for k, v in sorted(delta.items()) if k.startswith("busy_")}
    result = {
        "params": params, "slots": runner.slots, "engine": runner.pipe.engine,
        "step_s": step_s, "step_s_rounds": [r[0] for r in timed],
        "limit_s": limit_s, "ratio": step_s / limit_s,
        # A disk that reads and writes at once could beat the sum; max() is that bound.
        "limit_overlapped_s": max(delta["storage_read"] / read_bw, delta["storage_write"] / write_bw),
        "achieved_GBps": (delta["storage_read"] + delta["storage_write"]) / step_s / 1e9,
        "bytes": {k: delta[k] for k in ("storage_read", "storage_write", "host_to_device",
                                        "device_to_host")},
        "bytes_per_param": {
            "storage": (delta["storage_read"] + delta["storage_write"]) / params,
            "storage_read": delta["storage_read"] / params,
            "storage_write": delta["storage_write"] / params,
            "host_to_device": delta["host_to_device"] / params,
            "device_to_host": delta["device_to_host"] / params,
        },
        "busy_s": busy,
        "busy_fraction": {k.replace("busy_", ""): v / step_s for k, v in busy.items()},
        "chunks": delta["chunks"],
        "read_bw": read_bw, "write_bw": write_bw,
    }
    benchmark.extra_info.update(result)
    return result


@pytest.mark.parametrize("slots", SLOTS)
def test_step(benchmark, bench_dir, storage_limits, summary, slots):
    name = f"step_{STEP_PARAMS / 1e6:.0f}M_slots{slots}"
    require_disk(bench_dir, STEP_PARAMS * STATE_BYTES, f"the {name} test")
    runner = StepRunner(os.path.join(bench_dir, name), STEP_PARAMS, slots)
    try:
        result = measure_steps(benchmark, runner, storage_limits)
    finally:
        runner.close()
    # Single-thread rate of the bare Adam kernel: what compute would cost if it were serial.
    kernel_s = native.time_kernel(SUBGROUP, F32, F16, "fp32", 1)
    result["kernel_params_per_s_1thread"] = SUBGROUP / kernel_s
    result["compute_serial_s"] = STEP_PARAMS * kernel_s / SUBGROUP
    benchmark.extra_info.update(kernel_params_per_s_1thread=SUBGROUP / kernel_s)
    summary.setdefault("steps", {})[name] = result


ENGINES = ["uring", "threads"]


def alternating_runners(bench_dir: str, name: str, params: int, variants: dict):
    """One StepRunner per variant (name -> StepRunner keyword arguments) on the bench
    disk, alive together so their steps can alternate; closed at the end."""
    runners = {}
    try:
        for variant, kwargs in variants.items():
            runners[variant] = StepRunner(os.path.join(bench_dir, f"{name}_{variant}"), params,
                                          SLOTS[0], **kwargs)
        yield runners
    finally:
        for runner in runners.values():
            runner.close()


@pytest.fixture(scope="module")
def engine_runners(bench_dir):
    """One pipeline per engine, alive together so their steps can alternate."""
    if not smartinf.build_info()["io_uring"]:
        pytest.skip("built without liburing: no io_uring engine to compare with")
    require_disk(bench_dir, 2 * ENGINE_PARAMS * STATE_BYTES, "the engine comparison")
    yield from alternating_runners(bench_dir, "engine", ENGINE_PARAMS, {io: {"io": io} for io in ENGINES})


def measure_alternating(benchmark, storage_limits, summary, runners, variant, prefix,
                        ratio_key, top, bottom):
    """Times `variant`'s steps, a step of the other variant (untimed) before each round,
    records them as steps[prefix_variant], and once both are in, summary[ratio_key] = step
    time of `top` / step time of `bottom`."""
    others = [v for v in runners if v != variant]
    result = measure_steps(benchmark, runners[variant], storage_limits,
                           setup=runners[others[0]].step)
    steps = summary.setdefault("steps", {})
    steps[f"{prefix}_{variant}"] = result
    if f"{prefix}_{top}" in steps and f"{prefix}_{bottom}" in steps:
        summary[ratio_key] = steps[f"{prefix}_{top}"]["step_s"] / steps[f"{prefix}_{bottom}"]["step_s"]


@pytest.mark.parametrize("io", ENGINES)
def test_step_engine(benchmark, storage_limits, summary, engine_runners, io):
    # A step of the other engine (untimed) precedes each round: this VM disk runs slow for
    # a few seconds after heavy I/O (the previous test's), so back-to-back rounds of one
    # engine then the other measured the order, not the engine (0.66x to 1.75x).
    measure_alternating(benchmark, storage_limits, summary, engine_runners, io,
                        f"engine_{ENGINE_PARAMS / 1e6:.0f}M",
                        "engine_threads_vs_uring", "threads", "uring")


#: State formats (moments + master), bf16 params: bytes per param stored 12, 6.03, 4.03, 3.09.
STATE_FORMATS = {"fp32": {"state_dtype": "fp32"}, "int8": {"state_dtype": "int8"},
                 "int8_split": {"state_dtype": "int8", "master": "split"},
                 "int4_split": {"state_dtype": "int4", "master": "split"}}
DTYPE_PARAMS = env_int("SMARTINF_BENCH_DTYPE_PARAMS", 256 << 20)


@pytest.fixture(scope="module")
def dtype_runners(bench_dir):
    """The state formats on the same disk, alive together so their steps alternate."""
    require_disk(bench_dir, DTYPE_PARAMS * 2 * (12 + 6.1 + 4.1 + 3.1), "the state format comparison")
    yield from alternating_runners(bench_dir, "states", DTYPE_PARAMS,
                                   {d: dict(kw, param_dtype="bf16") for d, kw in STATE_FORMATS.items()})


@pytest.mark.parametrize("dtype", list(STATE_FORMATS))
def test_step_state_dtype(benchmark, storage_limits, summary, dtype_runners, dtype):
    """Each state format's step against its own storage limit (its bytes at the disk's
    bandwidths): int8 moves ~6 B/param each way instead of 12 (goal >= 1.7x), with the
    split master ~4 (goal: ZeRO-Infinity's 32 B / 8 B), int4 with it ~3.1."""
    measure_alternating(benchmark, storage_limits, summary, dtype_runners, dtype,
                        f"states_{DTYPE_PARAMS / 1e6:.0f}M",
                        "int8_vs_fp32_states", "fp32", "int8")
    steps = summary["steps"]
    prefix = f"states_{DTYPE_PARAMS / 1e6:.0f}M"
    for name in ("int8_split", "int4_split"):
        if f"{prefix}_{name}" in steps and f"{prefix}_fp32" in steps:
            summary[f"{name}_vs_fp32_states"] = \
                steps[f"{prefix}_fp32"]["step_s"] / steps[f"{prefix}_{name}"]["step_s"]


#: The I/O schedules of the ring (reads and write-backs together, or in turns).
SCHEDULE_PARAMS = env_int("SMARTINF_BENCH_SCHEDULE_PARAMS", 256 << 20)


@pytest.fixture(scope="module")
def schedule_runners(bench_dir):
    require_disk(bench_dir, 2 * SCHEDULE_PARAMS * STATE_BYTES, "the I/O schedule comparison")
    yield from alternating_runners(bench_dir, "schedule", SCHEDULE_PARAMS,
                                   {s: {"io_schedule": s} for s in ("mixed", "phased")})


@pytest.mark.parametrize("schedule", ["mixed", "phased"])
def test_step_io_schedule(benchmark, storage_limits, summary, schedule_runners, schedule):
    """fp32 states streamed with reads and write-backs in flight together, and in turns:
    which one a disk prefers is what the probe's mix curve tells io_schedule="auto"."""
    measure_alternating(benchmark, storage_limits, summary, schedule_runners, schedule,
                        f"schedule_{SCHEDULE_PARAMS / 1e6:.0f}M", "phased_vs_mixed", "phased", "mixed")


#: Two copies on disk against one and the step's logged gradients (copies="log").
COPIES_PARAMS = env_int("SMARTINF_BENCH_COPIES_PARAMS", 256 << 20)


@pytest.fixture(scope="module")
def copies_runners(bench_dir):
    require_disk(bench_dir, COPIES_PARAMS * (STATE_BYTES + 14), "the copies comparison")
    runners = alternating_runners(bench_dir, "copies", COPIES_PARAMS,
                                  {"two": {"param_dtype": "bf16"},
                                   "log": {"param_dtype": "bf16", "copies": "log"}})
    both = next(runners)
    for runner in both.values():  # bf16 gradients, as a bf16 model's
        runner.grads = [torch.from_numpy(g).to(torch.bfloat16) for g in runner.grads]
    yield both
    runners.close()


@pytest.mark.parametrize("copies", ["two", "log"])
def test_step_copies(benchmark, storage_limits, summary, copies_runners, copies):
    """fp32 states streamed with two copies on disk, and with one copy and the step's logged
    bf16 gradients: what each takes of the disk against the states' bytes (2.0 and about
    14 / 12), and the step's time (the log writes the gradients before the updates and syncs
    the journal each time the spares run out)."""
    runner = copies_runners[copies]
    measure_alternating(benchmark, storage_limits, summary, copies_runners, copies,
                        f"copies_{COPIES_PARAMS / 1e6:.0f}M", "log_vs_two_copies", "log", "two")
    states = 12 * runner.params
    disk = sum(os.path.getsize(os.path.join(runner.directory, f))
               for f in ("states.bin", "grads.bin", "journal")
               if os.path.exists(os.path.join(runner.directory, f)))
    summary.setdefault("disk_vs_states", {})[copies] = disk / states
    assert disk > states
