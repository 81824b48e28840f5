"""torch.profiler and cProfile over a span of a training loop (``Profiled``): the examples'
and benches' ``--profile-step``, a step and the next iteration's forward and backward (a step
finished meanwhile)."""
from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

import torch


class Profiled:
    """torch.profiler and cProfile (this thread's Python functions) from ``__init__`` to
    ``stop``, which writes their tables: by CPU time (every thread's ops), by the GPU's own
    time, and the Python functions' (by their own time, then with their callees'); and torch.profiler's timeline beside them
    (``.prof.trace.json.gz``)."""

    def __init__(self, cuda: bool) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.torch = torch.profiler.profile(activities=activities)
        self.functions = cProfile.Profile()
        self.torch.__enter__()
        self.functions.enable()

    def stop(self, path: Path) -> None:
        self.functions.disable()
        self.torch.__exit__(None, None, None)
        table = io.StringIO()
        stats = pstats.Stats(self.functions, stream=table)
        stats.sort_stats("tottime").print_stats(40)
        # and by what each call holds within it: where a phase's host time goes (DeepSpeed's
        # partitioning of 7 B's params, 17 ms a step, showed in neither table above)
        stats.sort_stats("cumulative").print_stats(60)
        # the timeline too (gzipped, beside the tables): which thread's call a wait overlaps
        self.torch.export_chrome_trace(str(path.with_suffix(".trace.json.gz")))
        events = self.torch.key_averages()
        path.write_text("\n\n".join([
            events.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=80),
            events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=80),
            table.getvalue()]))
