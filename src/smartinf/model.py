"""Traffic and scaling model of near-storage optimizer updates (pure Python, no I/O).

- ``traffic_per_param``: bytes moved per parameter per optimizer step on each link, for
  ZeRO-Infinity and for SmartUpdate (Table I of the Smart-Infinity paper).
- ``storage_bound_seconds`` / ``storage_bound_from_bytes``: the time a step cannot beat
  on a storage device of given read and write bandwidth (the denominator of the
  "step time / storage limit" ratio the demo and the benchmarks report).
- ``scaled_step_time``: the optimizer-step time on ``n`` near-storage devices,
  T_opt,n = max(T_opt / n, T_param_swap / min(n, B_PCIe / B_SSD)).

Bandwidths are bytes per second, times are seconds.
"""
from __future__ import annotations

#: fp32 master weight + Adam exp_avg + exp_avg_sq, bytes per parameter on storage.
STATE_BYTES = 12
SCHEMES = ("zero-infinity", "smartupdate")


def traffic_per_param(scheme: str, grad_bytes: int = 2, param_bytes: int = 2,
                      state_bytes: int = STATE_BYTES) -> dict[str, int]:
    """Bytes per parameter per step on each link (Table I of the Smart-Infinity paper).

    ``"zero-infinity"``: the host updates the params, so all optimizer states cross the
    host/storage interconnect twice (read ``state_bytes``, write ``state_bytes``), and the
    gradients, upcast to fp32, are offloaded to storage and read back (write 4 + read 4):
    32 B/param over the host link with Adam. ``grad_bytes`` and ``param_bytes`` do not
    change it (ZeRO-Infinity always swaps fp32 gradients).

    ``"smartupdate"``: the states go storage <-> compute inside the device (read
    ``state_bytes`` + write ``state_bytes`` = 24 B/param that never touch the host link);
    the host link carries only the gradient in (``grad_bytes``: 4 for fp32, 2 for
    fp16/bf16) and the updated low-precision params out (``param_bytes``).

    Keys: ``storage_read``, ``storage_write`` (bytes at the storage media),
    ``host_to_device``, ``device_to_host`` (bytes over the host/storage interconnect),
    ``host_link_total`` and ``storage_total``.
    """
    for name, value in (("grad_bytes", grad_bytes), ("param_bytes", param_bytes),
                        ("state_bytes", state_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    fp32_grad = 4
    if scheme == "zero-infinity":
        # Host writes grads + updated states to storage, reads states + grads back.
        read = state_bytes + fp32_grad
        write = state_bytes + fp32_grad
        h2d, d2h = write, read
    elif scheme == "smartupdate":
        read = write = state_bytes
        h2d, d2h = grad_bytes, param_bytes
    else:
        raise ValueError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    return {
        "storage_read": read,
        "storage_write": write,
        "storage_total": read + write,
        "host_to_device": h2d,
        "device_to_host": d2h,
        "host_link_total": h2d + d2h,
    }


def storage_bound_from_bytes(bytes_read: float, bytes_written: float,
                             read_bps: float, write_bps: float) -> float:
    """Seconds to read ``bytes_read`` and write ``bytes_written`` at the raw bandwidths,
    one after the other (the device's reads and writes share it): a step's storage limit."""
    if read_bps <= 0 or write_bps <= 0:
        raise ValueError(f"bandwidths must be positive, got read={read_bps!r} write={write_bps!r}")
    if bytes_read < 0 or bytes_written < 0:
        raise ValueError("byte counts must not be negative")
    return bytes_read / read_bps + bytes_written / write_bps


def storage_bound_seconds(numel: int, read_bps: float, write_bps: float,
                          state_bytes: int = STATE_BYTES) -> float:
    """The storage limit of one optimizer step over ``numel`` params: every state is read
    once and written once, ``numel * state_bytes / read_bps + numel * state_bytes / write_bps``."""
    if numel < 0:
        raise ValueError(f"numel must not be negative, got {numel}")
    nbytes = numel * state_bytes
    return storage_bound_from_bytes(nbytes, nbytes, read_bps, write_bps)


def scaled_step_time(t_opt: float, t_param_swap: float, n: int,
                     b_pcie: float, b_ssd: float) -> float:
    """Optimizer-step time on ``n`` near-storage devices (the paper's scaling model).

    ``T_opt,n = max(T_opt / n, T_param_swap / min(n, B_PCIe / B_SSD))``: the update work
    (``t_opt`` on one device) divides over the devices, while the parameter swap over the
    shared host link (``t_param_swap`` at one device's storage bandwidth) speeds up only
    until the devices' aggregate bandwidth ``n * b_ssd`` fills the link ``b_pcie``.
    The whole training step is ``T_opt,n + T_fwd + T_bwd``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if b_pcie <= 0 or b_ssd <= 0:
        raise ValueError(f"bandwidths must be positive, got b_pcie={b_pcie!r} b_ssd={b_ssd!r}")
    if t_opt < 0 or t_param_swap < 0:
        raise ValueError("times must not be negative")
    return max(t_opt / n, t_param_swap / min(n, b_pcie / b_ssd))
