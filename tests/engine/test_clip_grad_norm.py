"""OffloadAdam.clip_grad_norm_: clipping from outside step(), for loops that clip between backward and step().

It must do what OffloadAdam(max_grad_norm=c) does, bit for bit, and what torch.nn.utils.clip_grad_norm_ does before
torch's AdamW, to torch's fp32 tolerance; its refusals change nothing."""

import math

import pytest
import torch
from helpers import HYPER, Toy, batch, loss_of, on_sim, train

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam

CLIP = 0.5  # the Toy's gradient norm is about 2-4: every step clips


def clipped_run(clip, steps=3, micro_batches=1, outside=True, **options):
    """The seeded Toy trained `steps` steps, clipped to `clip` by clip_grad_norm_ (`outside`) or by max_grad_norm;
    its parameters and the norms clipping measured."""
    torch.manual_seed(0)
    model = Toy()
    norms = []
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300,
                          max_grad_norm=None if outside else clip, **options, **HYPER)
        for step in range(steps):
            for micro in range(micro_batches):
                (loss_of(model, *batch(100 * step + micro)) / micro_batches).backward()
            if outside:
                norms.append(opt.clip_grad_norm_(clip))
            opt.step()
            if clip is not None:
                if not outside:
                    norms.append(torch.tensor(opt.last_grad_norm, dtype=torch.float32))
                assert torch.equal(torch.tensor(opt.last_grad_norm, dtype=torch.float32), norms[-1])  # what step() used
            opt.zero_grad()
        dev.synchronize()
        counts = opt.speculation
    return [p.detach().clone() for p in model.parameters()], norms, counts


def torch_run(clip, steps=3, micro_batches=1):
    """The same run on a plain copy of the Toy: torch's clip_grad_norm_, then torch's AdamW."""
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    norms = []
    for step in range(steps):
        for micro in range(micro_batches):
            (loss_of(model, *batch(100 * step + micro)) / micro_batches).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("options", [{}, {"min_offload_numel": 100}, {"speculative": True}],
                         ids=["offloaded", "biases-on-device", "speculative"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_clipping_from_outside_equals_max_grad_norm_bit_for_bit(options, micro_batches):
    if options.get("speculative"):
        options = {**options, "backwards_per_step": micro_batches}
    outside, outside_norms, counts = clipped_run(CLIP, micro_batches=micro_batches, **options)
    inside, inside_norms, _ = clipped_run(CLIP, micro_batches=micro_batches, outside=False, **options)
    assert all(torch.equal(a, b) for a, b in zip(outside, inside, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outside_norms, inside_norms, strict=True))
    assert all(norm > CLIP for norm in outside_norms)  # every step clipped
    if options.get("speculative"):
        assert counts["redone"] > 0 and counts["kept"] == 0  # clipped: every speculation redone


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("clip", [CLIP, math.inf])
def test_clipping_from_outside_matches_torch(clip, micro_batches):
    ours, our_norms, _ = clipped_run(clip, micro_batches=micro_batches, min_offload_numel=100)
    theirs, their_norms = torch_run(clip, micro_batches=micro_batches)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    # the norm: float64 partial sums per subgroup here, fp32 per-tensor norms in torch, so equal to an fp32 rounding
    for a, b in zip(our_norms, their_norms, strict=True):
        assert a.shape == () and a.dtype == torch.float32
        torch.testing.assert_close(a, b)


def test_infinity_measures_without_clipping_and_keeps_speculations():
    measured, norms, counts = clipped_run(math.inf, speculative=True)
    unclipped, _, _ = clipped_run(None, outside=False, speculative=True)  # no clipping at all
    assert all(torch.equal(a, b) for a, b in zip(measured, unclipped, strict=True))
    assert all(norm > CLIP for norm in norms)
    assert counts["redone"] == 0 and counts["kept"] > 0  # the coefficient a clean, unclipped step has


def snapshot(opt, model):
    return ([p.detach().clone() for p in model.parameters()],
            {name: sub.buffers[name].clone() for sub in opt.subgroups for name in ("master", "grad")},
            [slot.step for slot in opt.packing.slots.values()])


def assert_same(a, b):
    weights_a, buffers_a, steps_a = a
    weights_b, buffers_b, steps_b = b
    assert all(torch.equal(x, y) for x, y in zip(weights_a, weights_b, strict=True))
    assert buffers_a.keys() == buffers_b.keys() and all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)
    assert steps_a == steps_b


@pytest.mark.parametrize("call, match", [
    (lambda opt: opt.clip_grad_norm_(1.0, norm_type=1.0), "L2 norm only"),
    (lambda opt: opt.clip_grad_norm_(1.0, norm_type=math.inf), "L2 norm only"),
    (lambda opt: opt.clip_grad_norm_(-1.0), "max_norm must be >= 0"),
    (lambda opt: opt.clip_grad_norm_(math.nan), "max_norm must be >= 0"),
])
def test_bad_arguments_are_refused_and_change_nothing(sim, call, match):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    opt = OffloadAdam(model.parameters(), sim, subgroup_numel=300, **HYPER)
    loss_of(model, *batch(0)).backward()
    before = snapshot(opt, model)
    with pytest.raises(ValueError, match=match):
        call(opt)
    assert_same(snapshot(opt, model), before)
    assert not opt._this_step  # nothing gathered
    opt.step()  # and the step runs as if nothing had been asked
    assert opt.updates == 1 and opt.packing.slots[model.mlp[0].weight].step == 1


def test_an_optimizer_that_clips_itself_refuses_a_second_clipper(sim):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    opt = OffloadAdam(model.parameters(), sim, subgroup_numel=300, max_grad_norm=CLIP, **HYPER)
    loss_of(model, *batch(0)).backward()
    before = snapshot(opt, model)
    with pytest.raises(ValueError, match="clip in one place"):
        opt.clip_grad_norm_(1.0)
    assert_same(snapshot(opt, model), before)


def test_clipping_twice_or_a_backward_after_clipping_is_refused(sim):
    torch.manual_seed(0)
    model = on_sim(Toy(), sim)
    opt = OffloadAdam(model.parameters(), sim, subgroup_numel=300, **HYPER)
    loss_of(model, *batch(0)).backward()
    norm = opt.clip_grad_norm_(CLIP)
    with pytest.raises(RuntimeError, match="ran already in this step"):
        opt.clip_grad_norm_(CLIP)
    with pytest.raises(RuntimeError, match="a backward ran after clip_grad_norm_"):
        loss_of(model, *batch(1)).backward()
    opt.zero_grad()  # drops the step and its norm
    loss_of(model, *batch(0)).backward()
    assert torch.equal(opt.clip_grad_norm_(CLIP), norm)  # the same gradients again, measured afresh


def test_an_overflow_found_by_clipping_still_skips_the_step():
    torch.manual_seed(0)
    model = Toy().to(torch.float16)
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, loss_scale="dynamic", **HYPER)
        before = [p.detach().clone() for p in model.parameters()]
        opt.scale_loss(loss_of(model, *batch(0))).backward()  # 2**16 overflows fp16 gradients
        norm = opt.clip_grad_norm_(CLIP)
        opt.step()
        assert not math.isfinite(norm.item())  # as torch's clip_grad_norm_ says of an inf or NaN gradient
        assert opt.skipped_steps == 1 and opt.updates == 0 and opt.scale == 2.0 ** 15
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
        assert not any(slot.has_grad for slot in opt.packing.slots.values())  # gradients dropped
        assert all(not sub.buffers["grad"].any() for sub in opt.subgroups)
        train(model, opt, 1)  # and the next step runs (hooks armed, nothing left over)


class ForwardingWrapper:
    """What Lightning's LightningOptimizer does: attribute reads go to the optimizer, writes stay on the wrapper."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def clip_grad_norm_(self, *args):  # the optimizer's method, run with the wrapper as `self`
        return OffloadAdam.clip_grad_norm_(self, *args)


def test_clipping_through_a_wrapper_that_forwards_reads_reaches_the_step():
    wrapped, _, _ = clipped_run(CLIP, outside=False)
    torch.manual_seed(0)
    model = Toy()
    with device("sim") as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, **HYPER)
        wrapper = ForwardingWrapper(opt)
        for step in range(3):
            loss_of(model, *batch(100 * step)).backward()
            wrapper.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        dev.synchronize()
    assert all(torch.equal(a, b.detach()) for a, b in zip(wrapped, model.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [{}, {"speculative": True}], ids=["offloaded", "speculative"])
def test_on_cuda_clipping_from_outside_equals_max_grad_norm(options):
    """On a GPU that lags the host: clip_grad_norm_ gathers gradients whose copies may still be queued; the step
    it clips equals the one OffloadAdam(max_grad_norm=...) clips, and the norm is torch's on a plain copy."""
    from helpers import keep_gpu_busy

    results, norms = [], []
    for outside in (True, False):
        torch.manual_seed(0)
        model = Toy().cuda()
        with device("cuda") as dev:
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=300, max_grad_norm=None if outside else CLIP,
                              **options, **HYPER)
            for step in range(3):
                idx, targets = (t.cuda() for t in batch(100 * step))
                keep_gpu_busy()  # the gradients' copies queue behind this: the norm must wait for them
                loss_of(model, idx, targets).backward()
                if outside:
                    norms.append(opt.clip_grad_norm_(CLIP).item())
                keep_gpu_busy()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # embedding backward may sum in another order
    _, their_norms = torch_run(CLIP)
    torch.testing.assert_close(torch.tensor(norms), torch.stack(their_norms), rtol=1e-5, atol=1e-6)
