"""smartinf's pipeline counters an example records per step (both examples, as differences):
seconds busy per stage, the background commit's, the updates during backward, and those the
next forward finished (the tail's)."""
from __future__ import annotations

from typing import Any

import torch

PIPELINE_COUNTERS = ("busy_load", "busy_host_to_device", "busy_compute", "busy_device_to_host",
                     "busy_writeback", "busy_persist", "wait_commit", "twin_copies",
                     "durable_step", "speculative_updates", "retracted_updates",
                     # phased I/O: turns between reads and writes, and the drive's turns
                     # waited for while another rank of the host held them
                     "io_turns", "io_turn_waits",
                     # seconds with an update in flight, waited for, and hidden (the rest)
                     "update_s", "update_wait_s", "update_hidden_s",
                     # the updates finished while the next forward ran (the optimizer's)
                     "deferred_updates", "gather_waits", "gather_wait_s", "drain_s")


def counters(optimizer: Any) -> dict:
    """The counters now of ``optimizer``'s pipeline (none before it is opened), with each
    device's busy compute seconds and bytes each way over the host's link
    (``busy_compute_<i>``, ``host_to_device_<i>``, ``device_to_host_<i>``: which device held
    the step, and what crossed PCIe for it), and the CUDA caching allocator's retries
    (``alloc_retries``: a full GPU's frees wait for every stream, a step's tail too)."""
    pipeline = getattr(optimizer, "pipeline", None)
    if pipeline is None:
        return {}
    stats = {**pipeline.stats, **getattr(optimizer, "overlap_stats", {})}
    found = {k: stats.get(k, 0.0) for k in PIPELINE_COUNTERS}
    for i, device in enumerate(pipeline.device_stats):
        found[f"busy_compute_{i}"] = device.get("busy_compute", 0.0)
        for link in ("host_to_device", "device_to_host"):
            found[f"{link}_{i}"] = device.get(link, 0.0)
    if torch.cuda.is_available():  # each retry frees cached blocks: a wait for the whole GPU
        found["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return found


def difference(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
