"""ZeRO-3's ``offload_param`` to the CPU with the smartinf block (issue 62: a 65 B model's
params live in host memory beside its states): the example trains as DeepSpeed's own
ZeRO-3 + CPU Adam with the same offload, at world 1 and 2, on the CPU (gloo)."""
import math

import pytest

pytest.importorskip("deepspeed")
from test_deepspeed import Run, losses, params_rel_diff, train_all  # noqa: E402


@pytest.mark.parametrize("world", [1, 2])
def test_params_in_host_memory_train_as_deepspeed(tmp_path, disk_dir, world):
    """Loss for loss within 1e-5 (relative) of DeepSpeed's own, clipping acting and step 3's
    NaN skipped by both, the final params within 1e-5: test_deepspeed's fp32 bounds."""
    extra = ("--offload-param", "--nan-at", "3")
    ours, ref = train_all(tmp_path, world, Run(disk_dir, f"ours-{world}", extra),
                          Run(disk_dir, f"ref-{world}", extra, mode="deepspeed-cpu"))
    assert [s["skipped"] for s in ours["steps"]] == [s["skipped"] for s in ref["steps"]]
    for step, (a, b) in enumerate(zip(losses(ours), losses(ref)), 1):
        if step == 3:
            assert math.isnan(a) and math.isnan(b)
        else:
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert losses(ours)[-1] < losses(ours)[0]
    assert params_rel_diff(ours, ref) <= 1e-5
