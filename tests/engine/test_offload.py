"""OffloadAdam trains exactly like torch's AdamW: fp32 and bf16 models, accumulation, clipping, odd parameters."""

import threading
import time

import pytest
import torch
from helpers import HYPER, Toy, batch, fresh, loss_of, on_sim, train
from torch import nn

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam


def straight_and_first(steps_before_saving=3, **options):
    """Five uninterrupted steps, and a second run stopped after `steps_before_saving` with its checkpoint."""
    with device("sim") as dev:
        straight, opt = fresh(dev, **options)
        train(straight, opt, 5)
        opt.flush()  # a delayed update's last weights
    with device("sim") as dev:
        first, opt = fresh(dev, **options)
        train(first, opt, steps_before_saving)
        checkpoint = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "opt": opt.state_dict()}
    return straight, checkpoint


def pair(seed=0, **kwargs):
    torch.manual_seed(seed)
    ours = Toy()
    theirs = Toy()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("min_offload_numel", [0, 100])  # 100: the biases stay on the device
@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("subgroup_numel", [1 << 20, 300])
def test_fp32_training_matches_torch_adamw(micro_batches, subgroup_numel, min_offload_numel):
    ours, theirs = pair()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, subgroup_numel=subgroup_numel,
                          min_offload_numel=min_offload_numel, **HYPER)
        assert len(opt.kept) == (3 if min_offload_numel else 0)  # mlp.0.bias, mlp.2.bias, side.bias
        ours_losses = train(ours, opt, 5, micro_batches)
        if subgroup_numel == 300:
            assert len(opt.subgroups) > 3
    theirs_losses = train(theirs, torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER), 5, micro_batches)
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(theirs_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_accumulated_micro_batches_equal_one_big_batch():
    ours, theirs = pair()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, **HYPER)
        for step in range(3):
            for micro in range(2):  # two halves of one batch
                idx, targets = batch(step)
                half = slice(4 * micro, 4 * micro + 4)
                (loss_of(ours, idx[half], targets[half]) / 2).backward()
            opt.step()
            opt.zero_grad()
    ref = torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER)
    for step in range(3):
        idx, targets = batch(step)
        loss_of(theirs, idx, targets).backward()
        ref.step()
        ref.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("min_offload_numel", [0, 100])
def test_clipping_equals_clip_grad_norm(min_offload_numel):
    ours, theirs = pair()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, max_grad_norm=0.5, min_offload_numel=min_offload_numel,
                          **HYPER)
        train(ours, opt, 4)
        assert opt.last_grad_norm > 0.5  # the clip did something
    train(theirs, torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER), 4, clip=0.5)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_tied_and_sometimes_unused_parameters_behave_as_in_torch():
    ours, theirs = pair()
    def side_in(step):  # the side branch gets a gradient in step 1 only
        return step == 1

    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, **HYPER)
        assert ours.frozen not in opt.packing.slots  # frozen: never offloaded
        assert sum(s.param is ours.embed.weight for sub in opt.subgroups for s in sub.slots) == 1  # tied: once
        train(ours, opt, 4, use_side=side_in)
        steps = {name: opt.packing.slots[p].step for name, p in ours.named_parameters() if p.requires_grad}
    train(theirs, torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER), 4, use_side=side_in)
    assert steps["side.weight"] == 1 and steps["mlp.0.weight"] == 4
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_bf16_model_follows_the_fp32_master_trajectory_of_torch_adamw():
    torch.manual_seed(0)
    ours = Toy().to(torch.bfloat16)
    theirs = Toy().to(torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    masters = [p.detach().float().clone().requires_grad_(True) for p in theirs.parameters() if p.requires_grad]
    ref = torch.optim.AdamW(masters, foreach=False, **HYPER)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, **HYPER)
        train(ours, opt, 4)
        ours_masters = opt.master_weights()
    for step in range(4):
        idx, targets = batch(100 * step)
        loss_of(theirs, idx, targets).backward()
        trainable = [p for p in theirs.parameters() if p.requires_grad]
        for master, p in zip(masters, trainable, strict=True):
            master.grad = None if p.grad is None else p.grad.float()  # the unused branch gets none
            p.grad = None
        ref.step()
        with torch.no_grad():
            for master, p in zip(masters, trainable, strict=True):
                p.copy_(master)  # round to bf16, as OffloadAdam's upload does
    for a, b in zip(ours_masters, masters, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)  # bf16 weights: the same rounding of the same masters


def test_a_jittered_device_never_changes_the_result():
    results = []
    for jitter in (0.0, 1e-3):
        torch.manual_seed(0)
        model = Toy()
        with device("sim", jitter=jitter, seed=3) as dev:
            opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, **HYPER)
            train(model, opt, 3, micro_batches=2)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_gradients_leave_the_device_and_the_trace_shows_every_phase(sim):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    params_bytes = sim.ledger.used("device")
    opt = OffloadAdam(model.parameters(), sim, subgroup_numel=300, **HYPER)
    train(model, opt, 1)
    assert sim.ledger.used("device") == params_bytes  # no gradient left behind on the device
    assert all(p.grad is None for p in model.parameters())
    assert {"d2h", "cpu", "h2d"} <= {s.lane for s in sim.trace.spans}


@pytest.mark.parametrize("make, match", [
    (lambda dev, m: OffloadAdam([], dev), "empty parameter list|no parameter"),
    (lambda dev, m: OffloadAdam([m.frozen], dev), "no parameter that requires a gradient"),
    (lambda dev, m: OffloadAdam(Toy().parameters(), dev), "must be on the device"),
    (lambda dev, m: OffloadAdam(m.parameters(), dev, subgroup_numel=0), "subgroup_numel"),
    (lambda dev, m: OffloadAdam(m.parameters(), dev, max_grad_norm=-1.0), "max_grad_norm"),
    (lambda dev, m: OffloadAdam(m.parameters(), dev, delay_updates_after=-1), "delay_updates_after must be"),
    (lambda dev, m: OffloadAdam(m.parameters(), dev, delay_updates_after=True), "delay_updates_after must be"),
    (lambda dev, m: OffloadAdam(m.parameters(), dev, delay_updates_after=0, min_offload_numel=10),
     "needs every parameter offloaded"),
])
def test_bad_input_is_refused_clearly(sim, make, match):
    model = on_sim(Toy(), sim)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        make(sim, model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_loss_scaling_by_a_power_of_two_changes_nothing_and_an_overflow_skips_the_step():
    results = []
    for scale in (None, 1024.0):
        torch.manual_seed(0)
        model = Toy()
        with device("sim") as dev:
            opt = OffloadAdam(on_sim(model, dev).parameters(), dev, loss_scale=scale, **HYPER)
            for step in range(3):
                idx, targets = batch(step)
                opt.scale_loss(loss_of(model, idx, targets)).backward()
                opt.step()
                opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))  # x1024 then /1024 is exact

    torch.manual_seed(0)
    model = Toy().to(torch.float16)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, loss_scale="dynamic", **HYPER)
        idx, targets = batch(0)
        for _ in range(20):  # 2**16 overflows fp16 gradients: the scale backs off until a step is clean
            opt.scale_loss(loss_of(model, idx, targets)).backward()
            opt.step()
            if opt.clean_steps:
                break
        backed_off = opt.skipped_steps
        assert opt.clean_steps == 1 and opt.scale == 2.0**16 / 2**backed_off
        before = opt.state_dict()
        weights = [p.detach().clone() for p in model.parameters()]
        opt.loss_scale.scale = 1e30  # far past fp16: the gradients overflow
        opt.scale_loss(loss_of(model, idx, targets)).backward()
        opt.step()
        after = opt.state_dict()
        assert opt.skipped_steps == backed_off + 1 and opt.scale == 0.5e30
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
        assert max(saved["step"] for saved in after["state"].values()) == 1  # the skipped step counted nowhere
        for index, saved in before["state"].items():
            assert saved["step"] == after["state"][index]["step"]
            assert all(torch.equal(saved[k], after["state"][index][k]) for k in ("master", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("options", [{}, {"min_offload_numel": 100}, {"delay_updates_after": 1}])
def test_a_checkpoint_continues_training_bit_for_bit(options):
    straight, checkpoint = straight_and_first(**options)
    if "delay_updates_after" in options:  # saved with an update not yet sent: the model is one update behind
        assert checkpoint["opt"]["unsent"]
    with device("sim") as dev:
        resumed, opt = fresh(dev, **options)
        resumed.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        for step in range(3, 5):  # the same batches the straight run saw in steps 3 and 4
            idx, targets = batch(100 * step)
            loss_of(resumed, idx, targets).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(sim):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    opt = OffloadAdam(model.parameters(), sim, **HYPER)
    other = on_sim(Toy(width=8), sim)
    other_state = OffloadAdam(other.parameters(), sim, **HYPER).state_dict()
    before = opt.state_dict()
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(other_state)
    after = opt.state_dict()
    assert all(torch.equal(before["state"][i]["master"], after["state"][i]["master"]) for i in before["state"])


RESUME = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import batch, fresh, loss_of
from minioffload.devices import device
checkpoint = torch.load({path!r}, weights_only=False)
with device("sim") as dev:
    model, opt = fresh(dev)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    for step in range(3, 5):
        idx, targets = batch(100 * step)
        loss_of(model, idx, targets).backward()
        opt.step()
        opt.zero_grad()
torch.save([p.detach() for p in model.parameters()], {out!r})
"""


def test_a_checkpoint_loaded_in_a_new_process_continues_bit_for_bit(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    straight, checkpoint = straight_and_first()
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    script = RESUME.format(tests=str(Path(__file__).parents[1]), path=str(tmp_path / "ckpt.pt"),
                           out=str(tmp_path / "resumed.pt"))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed, strict=True))


def test_small_parameters_kept_on_the_device_send_no_copies(sim):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    opt = OffloadAdam(model.parameters(), sim, min_offload_numel=100, **HYPER)
    train(model, opt, 1)
    copied = {s.nbytes for s in sim.trace.spans if s.lane == "d2h"}
    assert 64 * 4 not in copied and 16 * 4 not in copied  # the biases never crossed the link
    assert all(p not in opt.packing.slots for p in opt.kept)


# the one-step delayed update (DPU) ----------------------------------------------------------------
def delayed_reference(model, steps, synchronous, micro_batches=1, clip=None):
    """torch AdamW on an fp32 master copy; the model trains on weights one update behind after the first
    `synchronous` steps (iteration t sees update t-2). Returns the losses and the master model."""
    master = Toy()
    master.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(master.parameters(), foreach=False, **HYPER)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            idx, targets = batch(100 * step + micro)
            loss = loss_of(model, idx, targets) / micro_batches
            loss.backward()
            total += loss.item()
        for p, q in zip(model.parameters(), master.parameters(), strict=True):
            q.grad, p.grad = p.grad, None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        before = [q.detach().clone() for q in master.parameters()]
        opt.step()
        schedule.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, q, old in zip(model.parameters(), master.parameters(), before, strict=True):
                p.copy_(q if step < synchronous else old)
        losses.append(total)
    return losses, master


@pytest.mark.parametrize("synchronous, micro_batches, clip", [(0, 1, None), (2, 1, 0.5), (1, 3, None)])
def test_delayed_updates_train_one_update_behind(synchronous, micro_batches, clip):
    ours, theirs = pair()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(ours, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          delay_updates_after=synchronous, **HYPER)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        losses = []
        for step in range(6):
            total = 0.0
            for micro in range(micro_batches):
                idx, targets = batch(100 * step + micro)
                loss = loss_of(ours, idx, targets) / micro_batches
                loss.backward()
                total += loss.item()
            opt.step()
            schedule.step()  # changes the LR while the delayed update runs: it must use the one of its step
            opt.zero_grad()
            losses.append(total)
        opt.flush()
        masters = [m.clone() for m in opt.master_weights()]
    theirs_losses, master = delayed_reference(theirs, 6, synchronous, micro_batches, clip)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(theirs_losses), rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # flushed: the model holds the last update
    for c, b in zip(masters, [p for p in master.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6)
    if synchronous == 0:  # the staleness is real: training without the delay takes another path
        _, plain = pair()
        plain_losses = train(plain, torch.optim.AdamW(plain.parameters(), foreach=False, **HYPER), 6)
        assert abs(plain_losses[-1] - losses[-1]) > 1e-4


def test_a_delayed_update_runs_behind_step_and_its_errors_surface(monkeypatch):
    import minioffload.engine.optimizer as offload

    gate, threads = threading.Event(), []

    def held_adam(*args, **kwargs):
        threads.append(threading.current_thread().name)
        assert gate.wait(10), "the test never opened the gate"
        return real_adam(*args, **kwargs)

    real_adam = offload.adam_fused
    monkeypatch.setattr(offload, "adam_fused", held_adam)
    torch.manual_seed(0)
    with device("sim") as dev:
        model = on_sim(Toy(), dev)
        opt = OffloadAdam(model.parameters(), dev, delay_updates_after=1, **HYPER)
        for step in range(2):
            if step == 1:
                gate.clear()
            else:
                gate.set()
            loss_of(model, *batch(step)).backward()
            opt.step()  # step 1 (delayed) returns while its update is held at the gate
            opt.zero_grad()
        for _ in range(1000):  # the update thread reaches the gate soon after step() returned
            if threads[-1] != "MainThread":
                break
            time.sleep(0.01)
        assert threads[0] == "MainThread" and threads[-1].startswith("offload-update")
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, *batch(5)).backward()  # the next backward runs while the update waits
        gate.set()
        opt.step()
        assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))

        def broken_adam(*args, **kwargs):
            raise RuntimeError("adam broke")

        monkeypatch.setattr(offload, "adam_fused", broken_adam)
        opt.zero_grad()
        loss_of(model, *batch(6)).backward()
        with pytest.raises(RuntimeError, match="adam broke"):
            opt.step()  # the update of the previous step() fails in the thread: the next call says so
            opt.flush()


def test_a_gradient_an_earlier_hook_takes_away_leaves_its_parameter_as_adamw_does():
    """A post-accumulate-grad hook registered before OffloadAdam's sets one gradient to None (a framework that
    consumes it): that parameter is not updated, as torch's AdamW leaves a parameter without a gradient."""
    def run(make_opt):
        torch.manual_seed(0)
        with device("sim") as dev:
            model = on_sim(Toy(), dev)
            first = next(p for p in model.parameters() if p.requires_grad)
            first.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            opt = make_opt(model, dev)
            for k in range(2):
                loss_of(model, *batch(k)).backward()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            return [p.detach().clone() for p in model.parameters()]

    ours = run(lambda model, dev: OffloadAdam(model.parameters(), dev, subgroup_numel=300, **HYPER))
    torchs = run(lambda model, dev: torch.optim.AdamW(model.parameters(), **HYPER))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, torchs, strict=True))


def test_a_closed_optimizer_is_freed_once_dropped_and_refuses_to_step():
    """The gradient hooks hold the optimizer where the garbage collector cannot see the cycle: without close() a
    dropped optimizer lives on with its model; after it, it is freed (and stepping it again is refused)."""
    import gc
    import weakref

    def dropped(close: bool):
        with device("sim") as dev:
            model, opt = fresh(dev)
            train(model, opt, 2)
            if close:
                opt.close()
                with pytest.raises(RuntimeError, match="after close"):
                    opt.step()
                opt.close()  # twice is harmless
            return weakref.ref(opt), model

    for close in (False, True):
        ref, model = dropped(close)
        gc.collect()
        assert (ref() is None) == close, f"close={close}: the optimizer {'lives' if ref() else 'was freed'}"

@pytest.mark.parametrize("options, thread", [({"delay_updates_after": 0}, "offload-update"),
                                             ({"speculative": True}, "speculative adam")])
def test_close_stops_the_update_worker_thread(options, thread):
    def workers() -> int:
        return sum(t.name.startswith(thread) and t.is_alive() for t in threading.enumerate())

    with device("sim") as dev:
        model, opt = fresh(dev, **options)
        train(model, opt, 2)
        running = workers()
        assert running >= 1, f"no {thread!r} thread ran: the test would pass without close() stopping it"
        opt.close()
        assert workers() == running - 1


def test_a_link_slower_than_backward_holds_gradients_to_one_subgroup_on_the_device():
    """Gradients wait on the device for their copies to the host; when the link lags (a busy host, a slow bus), at
    most the largest subgroup's wait at once, and the next one beside them (autograd makes it before its hook can
    wait), the bytes the planner counts: the host waits for the oldest copies. Without the bound every gradient of
    the backward piles up."""
    from minioffload.devices.common import Link

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])  # 16 KiB of gradient per layer
    slow = Link(bandwidth=2e6)  # 8 ms a gradient: backward runs far ahead of its copies
    with device("sim", d2h=slow) as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=2 * 64 * 64, **HYPER)
        start = len(dev.ledger.history)
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        held, most = 0, 0
        for event in dev.ledger.history[start:]:
            if event.tier == "device" and event.name.startswith("grad"):
                held += event.delta
                most = max(most, held)
    subgroup_bytes, grad_bytes = 2 * 64 * 64 * 4, 64 * 64 * 4
    assert opt.grads.max_in_flight == subgroup_bytes
    assert most == subgroup_bytes + grad_bytes < 8 * grad_bytes  # filled by the lagging copies, held by the bound
