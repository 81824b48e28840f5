"""Where the states a memory budget keeps in host memory are updated: on the host's cores,
or on the GPU over PCIe (``CudaDevice(memory="host")``), for the ``"gpu"`` block's and
``smartinf.optim``'s ``host_states``: by the probe's record where there is one
(``gpu_takes_host_states``; ``best_share``, the model's share of them on the GPU, the rest
on the cores), and the bytes of host memory the GPU takes (``host_states_budget``).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

from smartinf.pipeline.checkpoint import MANIFEST
from smartinf.pipeline.devices import GPU_HOST_DIRECTORY
from smartinf.planning.io_schedule import find_record, load_record
from smartinf.planning.model import state_bytes_per_param
from smartinf.planning.placement import BOTH_WAYS_SHARE, Placement, predict_placed, recorded_rates
from smartinf.planning.plan import _existing

logger = logging.getLogger("smartinf")


def gpu_takes_host_states(state_dtype: str, master: str, directory: str) -> tuple[bool, str]:
    """Whether the GPU updates the states kept in host memory faster than the host's cores
    (the ``"gpu"`` block's ``"host_states": "auto"``), and why. Over PCIe each param's states
    cross both ways (its gradient and params stay in the GPU's memory), so the GPU's rate is
    the link's over the states' bytes; the cores' is the probe's kernel rate. Without a
    probe record with both: the GPU for int8 and int4 moments (2.3x and 2.9x the cores on
    the lent H100's 14 update threads, `bench/measured/h100-gpu-host-states.json`), the cores for fp32
    (0.87x: 12 B a param each way)."""
    state = state_bytes_per_param(state_dtype, master)
    path = find_record(_existing(directory))
    figures = load_record(path, "move it away") if path else None
    rates = recorded_rates(figures, state_dtype, master) if figures else None
    if rates is None or math.isinf(rates["host_to_gpu_bps"]):
        quantized = state_dtype != "fp32"
        return quantized, (f"no probe record with the GPU's link and the host's kernel "
                           f"(python -m smartinf.probe DIR --record): {state_dtype} moments "
                           f"(~{state:.1f} B a param each way) on the "
                           + ("GPU" if quantized else "host's cores"))
    link = min(rates["host_to_gpu_bps"], rates["gpu_to_host_bps"]) * BOTH_WAYS_SHARE
    gpu_pps, host_pps = link / state, rates["host_pps"]
    share = best_share(rates, state)
    return gpu_pps > host_pps, (f"{path}: the GPU over PCIe {gpu_pps / 1e9:.2f} G params/s "
                                f"({link / 1e9:.1f} GB/s each way, {state:.2f} B a param), the "
                                f"host's cores {host_pps / 1e9:.2f} G params/s; the model "
                                f"has them share best at host_states={share:.2f}: "
                                f"{shared_update_s(rates, state, share):.3f} s a G params, "
                                f"{shared_update_s(rates, state, 1.0):.3f} s on the GPU alone, "
                                f"{shared_update_s(rates, state, 0.0):.3f} s on the cores alone "
                                f"(auto does not share: not yet measured)")


def shared_update_s(rates: dict, state_bytes: float, share: float) -> float:
    """The model's time (``placement.predict_placed``, its updates and PCIe) to update 1 G
    params of states kept in host memory with ``share`` of them on the GPU over PCIe and the
    rest on the host's cores, at once: the link carries the cores' gradients and params too."""
    placed = Placement(gpu=0.0, ram=(1 - share) * 1e9, streamed=0.0, gpu_host=share * 1e9)
    return predict_placed(placed, **rates, state_bytes=state_bytes).exposed_s


def best_share(rates: dict, state_bytes: float) -> float:
    """The share of the states in host memory on the GPU (in twentieths) that the model
    updates soonest, the larger one of a tie (fewer of the overlap's host copies)."""
    shares = [i / 20 for i in range(21)]
    return min(reversed(shares), key=lambda f: round(shared_update_s(rates, state_bytes, f), 6))


def check(host_states: Any, where: str = "host_states") -> None:
    """Refuses a ``host_states`` that is none of True, False, ``"auto"`` or a share in [0, 1]."""
    share = isinstance(host_states, (int, float)) and not isinstance(host_states, bool) \
        and 0 <= host_states <= 1
    if not (share or host_states in (True, False, "auto")):
        raise ValueError(f"{where} must be true (the GPU updates the states the memory_budget "
                         f"keeps in host memory), false (the host's cores), \"auto\" (where "
                         f"faster) or a share from 0 to 1 (that share on the GPU, the rest on "
                         f"the cores, at once); got {host_states!r}")


def host_states_budget(host_states: "bool | str | float", state_dtype: str, master: str,
                       memory_budget: int, holders: int, directory: str) -> int:
    """Bytes of host memory the GPU takes from the cores' memory tier (``memory_budget`` on
    each of ``holders`` directories) for its states in host memory (``CudaDevice(memory=
    "host")``, in ``directory``'s ``gpu-host/``): all for ``host_states=True``, none for
    False, that share of it for a number (the rest stays the cores': the sub-groups placed
    first go to the GPU, and both update theirs at once, as ZeRO-Offload++'s ``ratio``
    splits its states), and for ``"auto"`` all where the GPU updates them faster
    (``gpu_takes_host_states``, logged), none where not or where there is no GPU or no
    budget; but where ``directory`` holds a run, as that run placed them (in ``gpu-host/`` or
    not: its sub-groups are where it put them, and another device list would be refused).
    True or a share without a GPU or a budget is refused, saying why."""
    check(host_states)
    if not host_states:
        return 0
    run = os.path.isfile(os.path.join(directory, MANIFEST))
    held = os.path.isfile(os.path.join(directory, GPU_HOST_DIRECTORY, MANIFEST))
    import torch  # (not at import: plan's command line runs without torch's CUDA)
    budget = memory_budget * holders
    why_not = ("no CUDA GPU is visible here" if not torch.cuda.is_available() else
               "there is no memory_budget: no states are kept in host memory" if not budget else "")
    if why_not and host_states == "auto":
        return 0
    if why_not:
        raise ValueError(f"host_states={host_states!r} updates the states a memory_budget keeps in host "
                         f"memory on the GPU, and {why_not}: give a GPU and a memory_budget "
                         f"(or state_dtype='auto'), or leave host_states out")
    if host_states == "auto" and (held or run):
        logger.warning("smartinf: the states in host memory updated on the %s: %s holds a run "
                       "with them there", "GPU" if held else "host's cores", directory)
        return budget if held else 0
    if host_states == "auto":
        takes, why = gpu_takes_host_states(state_dtype, master, directory)
        logger.warning("smartinf: the states in host memory updated on the %s (host_states "
                       "says otherwise): %s", "GPU" if takes else "host's cores", why)
        return budget if takes else 0
    return budget if host_states is True else int(budget * host_states)


def cores_keep(memory_budget: int, holders: int, on_gpu: int) -> int:
    """What each of ``holders`` directories keeps of its ``memory_budget`` once the GPU took
    ``on_gpu`` bytes of them all (``host_states_budget``): none where it took all, the rest
    of each where it took a share."""
    return max(0, memory_budget - -(-on_gpu // holders)) if on_gpu else memory_budget
