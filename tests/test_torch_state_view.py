"""``opt.state`` and the state-dict hooks as torch's optimizers have them: what code reads and
resets through ``opt.state`` (moments logged, reset after a loss spike), and torch's hooks
around ``state_dict()`` / ``load_state_dict()``."""
from collections import defaultdict

import pytest
import torch

import smartinf.optim as so
from test_optim import CASES, IDS, SMALL, assert_models_close, make_model, reference_grads, \
    set_grads, train_both
from conftest import assert_close_fp32


def pair(directory, ours, theirs, kw, steps, **options):
    a, b = make_model(), make_model()
    oa = ours(a.parameters(), devices=[directory], **{**SMALL, **options}, **kw)
    ob = theirs(b.parameters(), **kw)
    train_both(a, oa, b, ob, range(steps))
    return a, oa, b, ob


def assert_states_close(oa, a, ob, b):
    """Every param's entry of ``oa.state`` holds torch's keys and values."""
    assert len(oa.state) == len(ob.state)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        mine, theirs = oa.state[pa], ob.state[pb]
        assert sorted(mine) == sorted(theirs), name
        for key, value in theirs.items():
            assert_close_fp32(mine[key].numpy(), value.numpy(), f"{name}.{key}")


@pytest.mark.parametrize("ours, theirs, kw", CASES, ids=IDS)
def test_opt_state_reads_as_torch(disk_dir, ours, theirs, kw):
    a, oa, b, ob = pair(disk_dir, ours, theirs, kw, 3)
    assert_states_close(oa, a, ob, b)
    train_both(a, oa, b, ob, range(3, 5))  # read again after a step: that step's states
    assert_states_close(oa, a, ob, b)
    oa.close()


def log_and_reset(opt, model):
    """The habit: moments logged through ``opt.state.get``, then reset in place where held."""
    norms = []
    for p in model.parameters():
        s = opt.state.get(p, {})
        if "exp_avg_sq" in s:
            norms.append(float(s["exp_avg_sq"].norm()))
            s["exp_avg"].zero_()
            s["exp_avg_sq"].zero_()
    return norms


def test_moments_reset_in_place_reach_the_next_step(disk_dir):
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 3)
    mine, theirs = log_and_reset(oa, a), log_and_reset(ob, b)
    assert len(mine) == len(theirs) == 4 and all(n > 0 for n in mine)
    assert mine == pytest.approx(theirs, rel=1e-5)
    train_both(a, oa, b, ob, range(3, 6))
    assert_models_close(a, b)
    assert_states_close(oa, a, ob, b)
    oa.close()


def test_states_replaced_through_opt_state_reach_the_next_step(disk_dir, tmp_path):
    a, oa, b, ob = pair(disk_dir, so.Adam, torch.optim.Adam, dict(lr=1e-2), 2)
    for opt, model in ((oa, a), (ob, b)):
        weight = next(model.parameters())
        opt.state[weight]["exp_avg"] = torch.full_like(weight, 0.25, dtype=torch.float32)
        opt.state[weight]["exp_avg_sq"].mul_(4)
    # what was written is what is read back, before the step too
    first = next(a.parameters())
    assert torch.equal(oa.state[first]["exp_avg"], torch.full_like(first, 0.25))
    train_both(a, oa, b, ob, range(2, 4))
    assert_models_close(a, b)
    # and what state_dict() exports, edits applied first
    oa.state[first]["exp_avg"].fill_(0.5)
    ob.state[next(b.parameters())]["exp_avg"].fill_(0.5)
    exported = oa.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exported, torch.full_like(first, 0.5))
    train_both(a, oa, b, ob, range(4, 6))
    assert_models_close(a, b)
    oa.close()


def test_every_state_reset_starts_afresh_as_torch(disk_dir):
    # one sub-group: the whole model's step count goes back to 0 with torch's
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 3,
                        subgroup_size=1 << 20)
    oa.state = defaultdict(dict)
    ob.state = defaultdict(dict)
    train_both(a, oa, b, ob, range(3, 6))
    assert_models_close(a, b)
    assert_states_close(oa, a, ob, b)
    assert int(oa.state[next(a.parameters())]["step"]) == 3
    oa.close()


def test_a_reset_that_splits_a_subgroups_step_count_is_refused(disk_dir):
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 2)
    del oa.state[next(a.parameters())]  # one param afresh, its sub-group's others at step 2
    before = [p.detach().clone() for p in a.parameters()]
    set_grads(a, reference_grads(b, 2))
    with pytest.raises(ValueError, match=r"one step count per sub-group.*nothing was written.*zero_\(\)"):
        oa.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    oa.state.forget()  # the edit dropped: the run goes on as before it
    train_both(a, oa, b, ob, range(2, 4))
    assert_models_close(a, b)
    oa.close()


def test_states_before_a_step_and_of_frozen_params_are_torchs(disk_dir):
    a, b = make_model(), make_model()
    for m in (a, b):
        m[0].bias.requires_grad_(False)
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert not oa.state and not ob.state
    assert oa.state[a[0].bias] == {} and ob.state[b[0].bias] == {}
    train_both(a, oa, b, ob, range(2))
    assert_states_close(oa, a, ob, b)
    oa.close()


def test_a_state_dict_loaded_over_unapplied_edits_wins(disk_dir):
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 2)
    saved = ob.state_dict()
    oa.state[next(a.parameters())]["exp_avg"].fill_(9.0)
    oa.load_state_dict(saved)
    train_both(a, oa, b, ob, range(2, 4))
    assert_models_close(a, b)
    oa.close()


def test_opt_state_copies_and_pickles_as_plain_dicts(disk_dir):
    import copy
    import pickle
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 1)
    snapshot = copy.deepcopy(oa.state)
    assert type(snapshot) is dict and all(type(v) is dict for v in snapshot.values())
    again = pickle.loads(pickle.dumps(oa.state[next(a.parameters())]))
    assert sorted(again) == ["exp_avg", "exp_avg_sq", "step"]
    oa.close()


def hooked(opt, calls):
    """torch's four state-dict hooks on ``opt``, recording their calls; the state_dict
    post-hook adds param names, the load pre-hook halves every lr it loads."""
    names = ["w0", "b0", "w1", "b1"]
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))

    def named(o, sd):
        calls.append("save-post")
        for g in sd["param_groups"]:
            g["param_names"] = [names[i] for i in g["params"]]
        return sd
    opt.register_state_dict_post_hook(named)

    def halved(o, sd):
        calls.append(("load-pre", sorted(n for g in sd["param_groups"] for n in g["param_names"])))
        return dict(sd, param_groups=[dict(g, lr=g["lr"] / 2) for g in sd["param_groups"]])
    opt.register_load_state_dict_pre_hook(halved)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))


def test_state_dict_hooks_run_as_torchs(disk_dir):
    a, oa, b, ob = pair(disk_dir, so.AdamW, torch.optim.AdamW, dict(lr=1e-2), 2)
    mine, theirs = [], []
    hooked(oa, mine)
    hooked(ob, theirs)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"][0]["param_names"] == sb["param_groups"][0]["param_names"]
    oa.load_state_dict(sa)
    ob.load_state_dict(sb)
    assert mine == theirs == ["save-pre", "save-post", ("load-pre", ["b0", "b1", "w0", "w1"]),
                              "load-post"]
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"] == 5e-3
    train_both(a, oa, b, ob, range(2, 4))
    assert_models_close(a, b)
    oa.close()


def test_a_reset_through_opt_state_with_a_split_master_is_the_fp32_masters(disk_dir):
    """bf16 params: a split master (rebuilt from the params as opt.state reads and writes
    the sub-groups) gives the bits an fp32 master gives, reset included."""
    runs = []
    for master in ("split", "fp32"):
        model = make_model(torch.bfloat16)
        opt = so.AdamW(model.parameters(), lr=1e-2, devices=[f"{disk_dir}/{master}"], master=master,
                       **SMALL)
        reference = make_model(torch.bfloat16)
        for step in range(5):
            if step == 3:
                log_and_reset(opt, model)
            set_grads(model, reference_grads(reference, step))
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()],
                     opt.state_dict()["state"][0]["exp_avg"].clone()))
        opt.close()
    (split, split_avg), (fp32, fp32_avg) = runs
    assert all(torch.equal(p, q) for p, q in zip(split, fp32))
    assert torch.equal(split_avg, fp32_avg)


# -- edits while updates run during backward (issue 88) --------------------------------------
def backward_pair(directory, steps):
    """AdamW and torch's on two copies of the model, trained ``steps`` steps with real
    backward passes (so smartinf.optim's updates start during backward, ``train_with_backward``)."""
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[directory], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    train_with_backward(a, oa, b, ob, range(steps))
    return a, oa, b, ob


def train_with_backward(a, oa, b, ob, steps, between=lambda model, opt: None):
    """Steps both on ``a``'s backward passes (torch's fed the same gradients);
    ``between(model, opt)`` after each backward."""
    for step in steps:
        torch.manual_seed(100 + step)
        a(torch.randn(16, 24)).pow(2).mean().backward()
        set_grads(b, [p.grad for p in a.parameters()])
        for model, opt in ((a, oa), (b, ob)):
            between(model, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)


def halve_exp_avg(opt, model, held):
    for t in held:
        t["exp_avg"].mul_(0.5)


def zero_moments(opt, model, held):
    for t in held:
        t["exp_avg"].zero_()
        t["exp_avg_sq"].zero_()


def reset_entries(opt, model, held):
    for p in model.parameters():
        opt.state[p] = {}


@pytest.mark.parametrize("edit", [halve_exp_avg, zero_moments, reset_entries])
@pytest.mark.parametrize("when", ["before_backward", "after_backward"])
def test_an_edit_reaches_the_next_update_as_torchs_with_updates_during_backward(disk_dir, edit, when):
    """torch's next step sees an edit made between steps, before or after the next backward;
    so does smartinf.optim's, whose updates start during that backward: the edited
    sub-groups' wait for step() (made before) or are retracted and redone (after, through
    tensors taken since the last step). Two and three steps on, the params, the states and
    the step count are torch's."""
    a, oa, b, ob = backward_pair(disk_dir, 3)
    held = {o: [o.state[p] for p in m.parameters()] for m, o in ((a, oa), (b, ob))}
    counts = oa._speculation.counts
    kept = counts.kept
    if when == "before_backward":
        edit(oa, a, held[oa])
        edit(ob, b, held[ob])
    train_with_backward(a, oa, b, ob, [3], lambda m, o: edit(o, m, held[o])
                        if when == "after_backward" else None)
    train_with_backward(a, oa, b, ob, range(4, 6))
    assert counts.kept > kept  # (updates did run during backward)
    assert_models_close(a, b)
    assert_states_close(oa, a, ob, b)
    steps = {int(v["step"]) for v in oa.state_dict()["state"].values()}
    assert steps == {int(v["step"]) for v in ob.state_dict()["state"].values()}
    assert steps == ({6} if edit is not reset_entries else {3})
    oa.close()


@pytest.mark.parametrize("checkpoint", ["state_dict", "save"])
def test_a_tensor_taken_before_state_dict_or_save_stays_the_live_state(disk_dir, tmp_path, checkpoint):
    a, oa, b, ob = backward_pair(disk_dir, 3)
    mine = [oa.state[p]["exp_avg"] for p in a.parameters()]
    theirs = [ob.state[p]["exp_avg"] for p in b.parameters()]
    oa.state_dict() if checkpoint == "state_dict" else oa.save(str(tmp_path / "saved"))
    for t in mine + theirs:
        t.mul_(0.5)
    assert torch.equal(oa.state_dict()["state"][0]["exp_avg"], mine[0])  # (applied: exported)
    train_with_backward(a, oa, b, ob, range(3, 5))
    assert_models_close(a, b)
    assert_states_close(oa, a, ob, b)
    oa.close()


def test_an_edit_through_a_tensor_taken_before_a_step_is_refused(disk_dir):
    """torch's tensors are its live states, stepped in place; smartinf.optim's are read from
    the devices, live until the next step: an edit through one after that step would be lost,
    so it is refused, naming what happened and what to do, and the run goes on without it."""
    a, oa, b, ob = backward_pair(disk_dir, 2)
    taken = oa.state[next(a.parameters())]["exp_avg"]
    train_with_backward(a, oa, b, ob, [2])
    taken.mul_(0.5)
    before = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(ValueError, match=r"changed in place.*'exp_avg'.*nothing was written.*"
                                         r"again after each step"):
        train_with_backward(a, oa, a, oa, [3])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    train_with_backward(a, oa, b, ob, range(3, 5))  # (the edit dropped, as torch never saw it)
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("restart", ["zero_", "replaced"])
def test_a_warm_restart_exports_and_steps_as_torchs(disk_dir, restart):
    """``step`` set to 0, the moments kept: torch's state_dict still holds every entry (at
    step 0), and the next step's bias correction is step 1's."""
    a, oa, b, ob = backward_pair(disk_dir, 6)
    for opt in (oa, ob):
        for s in opt.state.values():
            if restart == "zero_":
                s["step"].zero_()
            else:
                s["step"] = torch.tensor(0.0)
    mine, theirs = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(mine) == sorted(theirs) and len(theirs) == 4
    for k, entry in theirs.items():
        assert float(mine[k]["step"]) == float(entry["step"]) == 0.0
        for n in ("exp_avg", "exp_avg_sq"):
            assert_close_fp32(mine[k][n].numpy(), entry[n].numpy(), f"{k}.{n}")
    train_with_backward(a, oa, b, ob, [6])
    assert_models_close(a, b)
    assert_states_close(oa, a, ob, b)
    assert int(oa.state[next(a.parameters())]["step"]) == 1
    oa.close()
