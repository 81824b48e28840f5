"""Two processes, the ranks of one host, each streaming its own fp32 states from one drive:
reads and write-backs mixed; in turns, each process's alone (``SMARTINF_IO_TURNS=process``);
and in the drive's turns across both (``host``, the default with phased I/O:
``pipeline/host_turns.h``). Each mode's processes live through all their rounds, the modes'
rounds alternate, and a round is both ranks' step begun together: its time is the slower
rank's. Medians of ``ROUNDS``. Results: ``bench/results/ranks_io.json``."""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics

from conftest import RESULTS, env_int, require_disk
from test_step import ROUNDS, SLOTS, STATE_BYTES, StepRunner

RANK_PARAMS = env_int("SMARTINF_BENCH_RANK_PARAMS", 128 << 20)
MODES = {"mixed": ("mixed", "host"), "phased-process": ("phased", "process"),
         "phased-host": ("phased", "host")}


def rank(directory: str, schedule: str, turns: str, go, done) -> None:
    """One rank: a warm-up step, then a step each time ``go`` says so, its seconds and
    turn waits to ``done`` (None to stop)."""
    os.environ["SMARTINF_IO_TURNS"] = turns  # (read by the native rings as they start)
    runner = StepRunner(directory, RANK_PARAMS, SLOTS[0], io_schedule=schedule)
    try:
        runner.step()
        done.put(("ready", 0.0, 0))
        while go.get():
            runner.step()
            seconds, delta = runner.rounds[-1]
            done.put(("step", seconds, int(delta.get("io_turn_waits", 0))))
    finally:
        runner.close()


def test_ranks_on_one_drive(benchmark, bench_dir):
    require_disk(bench_dir, 2 * len(MODES) * RANK_PARAMS * STATE_BYTES, "two ranks per mode")
    ctx = multiprocessing.get_context("fork")
    ranks = {}
    for mode, (schedule, turns) in MODES.items():
        queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
        procs = [ctx.Process(target=rank, args=(os.path.join(bench_dir, f"{mode}-{r}"), schedule,
                                                 turns, go, done)) for r, (go, done) in enumerate(queues)]
        for p in procs:
            p.start()
        for _, done in queues:
            assert done.get(timeout=600)[0] == "ready"
        ranks[mode] = (procs, queues)

    def round_of(mode):
        _, queues = ranks[mode]
        for go, _ in queues:
            go.put(True)
        got = [done.get(timeout=600) for _, done in queues]
        return max(s for _, s, _ in got), sum(w for _, _, w in got)

    timed = {mode: [] for mode in MODES}
    for _ in range(ROUNDS):
        for mode in MODES:  # alternating: this disk drifts between runs
            timed[mode].append(round_of(mode))
    benchmark.pedantic(round_of, args=("phased-host",), rounds=1, iterations=1)
    for procs, queues in ranks.values():
        for go, _ in queues:
            go.put(False)
        for p in procs:
            p.join(timeout=600)
            assert p.exitcode == 0
    medians = {m: statistics.median(s for s, _ in rounds) for m, rounds in timed.items()}
    record = {"rank_params": RANK_PARAMS, "ranks": 2, "rounds": ROUNDS,
              "step_s": {m: [s for s, _ in r] for m, r in timed.items()},
              "turn_waits": {m: [w for _, w in r] for m, r in timed.items()},
              "median_step_s": medians,
              "phased_host_vs_process": medians["phased-host"] / medians["phased-process"],
              "phased_host_vs_mixed": medians["phased-host"] / medians["mixed"]}
    print("\n" + json.dumps(record, indent=1))
    benchmark.extra_info.update(record)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "ranks_io.json"), "w") as f:
        json.dump(record, f, indent=1)
    assert all(w == 0 for w in record["turn_waits"]["phased-process"] + record["turn_waits"]["mixed"])
