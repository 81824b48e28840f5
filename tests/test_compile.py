"""torch.compile over code that calls ``smartinf.optim``'s step: torch's recipe
(https://pytorch.org/tutorials/recipes/compiling_optimizer.html, ``opt.step`` compiled) and a
whole train step compiled. The step and the hooks that start updates during backward are kept
out of the graphs (nothing of smartinf is traced), and the params are torch's AdamW's."""
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

import smartinf.optim as so
from test_optim import SMALL, assert_models_close, make_model, reference_grads, set_grads


@pytest.fixture
def graphs():
    """A backend that records each graph made and runs it through AOT autograd (where issue
    88's failure was); dynamo reset after (its graphs keep later steps in step())."""
    made = []
    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        made.append(gm)
        return aot_eager(gm, example_inputs)
    torch._dynamo.reset()
    yield made, backend
    torch._dynamo.reset()


def traced_smartinf(made):
    """The graph nodes traced from smartinf's source."""
    part = f"{os.sep}smartinf{os.sep}"
    return [node for gm in made for node in gm.graph.nodes
            if part in (node.meta.get("stack_trace") or "")]


def test_compiled_opt_step_is_torchs(disk_dir, graphs):
    made, backend = graphs
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)

    @torch.compile(fullgraph=False, backend=backend)
    def step():
        oa.step()
    for i in range(4):
        set_grads(a, reference_grads(b, i))
        step()
        ob.step()
    assert_models_close(a, b)
    assert made == []  # (the step is a graph break, as torch's optimizers' state_dict is)
    assert int(oa.state_dict()["state"][0]["step"]) == 4
    oa.close()


def test_a_compiled_train_step_is_torchs(disk_dir, graphs):
    """Forward, backward and step in one compiled function: the forward compiled, the
    updates started during backward (their hooks run inside the compiled frame) and the step
    run as without compile."""
    made, backend = graphs
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)

    @torch.compile(backend=backend)
    def train_step(x):
        loss = a(x).pow(2).mean()
        loss.backward()
        set_grads(b, [p.grad for p in a.parameters()])  # (torch's fed the same gradients)
        oa.step()
        return loss
    for i in range(4):
        torch.manual_seed(i)
        train_step(torch.randn(16, 24))
        ob.step()
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
    assert_models_close(a, b)
    assert made and not traced_smartinf(made)  # the forward's graph only
    assert oa._speculation.counts.kept > 0  # (on the CPU too here: tests/conftest.py)
    oa.close()
