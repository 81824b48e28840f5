"""The traffic and storage-limit model the demo and benchmarks report against."""
import pytest

from smartinf import model


def test_table_one_traffic_per_param():
    ours = model.traffic_per_param("smartupdate", grad_bytes=2, param_bytes=2)
    zero = model.traffic_per_param("zero-infinity")
    # SmartUpdate: 24 B/param of states stay behind the device; 4 B cross the host link.
    assert (ours["storage_read"], ours["storage_write"], ours["storage_total"]) == (12, 12, 24)
    assert (ours["host_to_device"], ours["device_to_host"], ours["host_link_total"]) == (2, 2, 4)
    # ZeRO-Infinity: states and fp32 gradients both ways over the host link.
    assert zero["storage_total"] == 32 and zero["host_link_total"] == 32
    assert model.traffic_per_param("smartupdate", 4, 2)["host_link_total"] == 6
    assert model.traffic_per_param("zero-infinity", 4, 4) == zero  # always fp32 grads


def test_storage_limit_is_read_then_write_time():
    assert model.storage_bound_from_bytes(3e9, 1e9, 1.5e9, 2e9) == pytest.approx(2.5)
    # 1 M params: 12 MB read at 1.2 GB/s + 12 MB written at 2.4 GB/s.
    assert model.storage_bound_seconds(10**6, 1.2e9, 2.4e9) == pytest.approx(0.015)


def test_scaling_model_saturates_at_the_host_link():
    t = dict(t_opt=8.0, t_param_swap=4.0, b_pcie=16e9, b_ssd=4e9)
    assert model.scaled_step_time(n=1, **t) == 8.0  # update-bound on one device
    assert model.scaled_step_time(n=2, **t) == 4.0
    # Beyond 4 devices (16 / 4) the param swap no longer speeds up: 4 / 4 = 1 s.
    assert model.scaled_step_time(n=8, **t) == 1.0
    assert model.scaled_step_time(n=16, **t) == 1.0


@pytest.mark.parametrize("call, match", [
    (lambda: model.traffic_per_param("zero-offload"), "unknown scheme"),
    (lambda: model.traffic_per_param("smartupdate", grad_bytes=0), "grad_bytes"),
    (lambda: model.traffic_per_param("smartupdate", param_bytes=True), "param_bytes"),
    (lambda: model.storage_bound_from_bytes(1, 1, 0, 1), "positive"),
    (lambda: model.storage_bound_from_bytes(-1, 1, 1, 1), "negative"),
    (lambda: model.storage_bound_seconds(-5, 1, 1), "negative"),
    (lambda: model.scaled_step_time(1, 1, 0, 1, 1), "positive int"),
    (lambda: model.scaled_step_time(1, 1, 2, 0, 1), "positive"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
