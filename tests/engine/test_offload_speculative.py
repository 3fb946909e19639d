"""Bucketed gradient copies, one upload per subgroup and the speculative update (issue 19) change when work runs, never
what it computes: every run here must end with weights bit for bit those of the plain synchronous OffloadAdam."""

import threading

import numba
import pytest
import torch
from helpers import HYPER, Toy, batch, keep_gpu_busy, loss_of, on_sim

from minioffload.devices import device
from minioffload.engine import speculative
from minioffload.engine.optimizer import OffloadAdam

PLAIN = {}
VARIANTS = {
    "buckets": {"bucket_numel": 200},
    "speculative": {"speculative": True},
    "both": {"bucket_numel": 200, "speculative": True},
    "buckets bigger than subgroups": {"bucket_numel": 1 << 20, "speculative": True},
}


def run(options, steps=4, micro_batches=1, dtype=torch.float32, use_side=lambda step: False, jitter=0.0,
        losses_scale=None, **common):
    """Train the seeded Toy; its final weights, the optimizer's counters and the traces' lanes."""
    torch.manual_seed(0)
    with device("sim", jitter=jitter, seed=1) as dev:
        model = on_sim(Toy(width=16).to(dtype), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=600, **common, **options, **HYPER)
        for step in range(steps):
            for micro in range(micro_batches):
                idx, targets = batch(100 * step + micro)
                loss = loss_of(model, idx, targets, use_side(step)) / micro_batches
                if losses_scale is not None:
                    loss = loss * losses_scale(step)
                opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
        dev.synchronize()
        names = {s.name for s in dev.trace.spans}
        return [p.detach().clone() for p in model.parameters()], (opt.updates, opt.skipped_steps, opt.scale), names


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variant_trains_exactly_like_the_synchronous_step(variant, dtype):
    reference, counts, _ = run(PLAIN, dtype=dtype)
    weights, counts_variant, names = run(VARIANTS[variant], dtype=dtype)
    assert same(reference, weights)
    assert counts == counts_variant
    if VARIANTS[variant].get("speculative"):
        assert any("speculative" in name for name in names)  # the update did run during backward


@pytest.mark.parametrize("clip", [1e-3, 1e3])  # every step clipped (all redone) / never clipped (all kept)
def test_clipping_gives_the_synchronous_result_whether_the_speculation_holds_or_not(clip):
    reference, _, _ = run(PLAIN, max_grad_norm=clip)
    for options in VARIANTS.values():
        assert same(reference, run(options, max_grad_norm=clip)[0])
    torch.manual_seed(0)
    with device("sim") as dev:
        model = on_sim(Toy(width=16), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=600, speculative=True, max_grad_norm=clip, **HYPER)
        loss_of(model, *batch(0), use_side=True).backward()
        opt.step()
        clipped = clip < 1
        assert opt.speculation == {"kept": 0 if clipped else len(opt.subgroups), "taken back": 0,
                                   "redone": len(opt.subgroups) if clipped else 0}


def test_an_overflow_skips_the_step_and_takes_the_speculated_weights_back():
    huge = lambda step: 1e38 if step == 1 else 1.0  # noqa: E731  (step 1 overflows in fp32 once scaled)
    reference, counts, _ = run(PLAIN, loss_scale="dynamic", losses_scale=huge)
    assert counts[1] == 1  # one skipped step in the reference too
    for options in VARIANTS.values():
        weights, counts_variant, _ = run(options, loss_scale="dynamic", losses_scale=huge)
        assert same(reference, weights) and counts == counts_variant


def test_accumulation_speculates_on_the_last_micro_batch_only():
    reference, _, _ = run(PLAIN, micro_batches=3)
    assert same(reference, run({"speculative": True, "backwards_per_step": 3}, micro_batches=3)[0])
    assert same(reference, run({"speculative": True, "backwards_per_step": 3, "bucket_numel": 100},
                               micro_batches=3)[0])


def test_parameters_that_sometimes_get_no_gradient_and_kept_ones_change_nothing():
    sometimes = lambda step: step % 2 == 0  # noqa: E731
    reference, _, _ = run(PLAIN, use_side=sometimes, min_offload_numel=20, max_grad_norm=0.5)
    for options in VARIANTS.values():
        assert same(reference, run(options, use_side=sometimes, min_offload_numel=20, max_grad_norm=0.5)[0])


class Mixed(torch.nn.Module):
    """A bf16 layer and an fp32 gain: one subgroup of two dtypes, which cannot be one flat device tensor."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.gain = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (self.layer(x).float() * self.gain).square().mean()


def test_a_subgroup_of_mixed_dtypes_goes_up_tensor_by_tensor_and_still_matches():
    def mixed(options):
        torch.manual_seed(0)
        with device("sim") as dev:
            model = on_sim(Mixed(), dev)
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=1 << 20, max_grad_norm=0.05, **options, **HYPER)
            assert len(opt.subgroups) == 1 and opt.subgroups[0].weights is None
            inputs = torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            for step in range(4):
                model(inputs[step]).backward()
                opt.step()
                opt.zero_grad()
            model(inputs[9]).backward()
            opt.zero_grad()  # a speculation taken back, tensor by tensor
            dev.synchronize()
            return [p.detach().clone() for p in model.parameters()], opt.updates

    reference = mixed(PLAIN)
    for options in VARIANTS.values():
        weights = mixed(options)
        assert same(reference[0], weights[0]) and reference[1] == weights[1]


def test_a_jittered_device_never_changes_the_result():
    reference, _, _ = run(PLAIN)
    for options in VARIANTS.values():
        assert same(reference, run(options, jitter=2e-4)[0])


def test_a_bucket_leaves_in_one_copy_and_a_subgroup_goes_up_in_one():
    torch.manual_seed(0)
    with device("sim") as dev:
        model = on_sim(Toy(width=16), dev)
        tensors = len(list(model.parameters())) - 1  # one is frozen
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=1 << 20, bucket_numel=1 << 20, **HYPER)
        assert len(opt.subgroups) == 1 and len(opt.subgroups[0].buckets) == 1
        loss_of(model, *batch(0)).backward()
        opt.step()
        dev.synchronize()
        d2h = [s for s in dev.trace.spans if s.lane == "d2h"]
        h2d = [s for s in dev.trace.spans if s.lane == "h2d"]
        assert tensors > 2 and len(d2h) == 1 and len(h2d) == 1
        assert all(p.data_ptr() == opt.subgroups[0].weights.data_ptr() + 4 * slot.offset
                   for p, slot in opt.packing.slots.items())


def test_a_backward_more_than_declared_is_refused_and_loses_nothing():
    torch.manual_seed(0)
    with device("sim") as dev:
        model = on_sim(Toy(), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=600, speculative=True, **HYPER)
        before = [p.detach().clone() for p in model.parameters()]
        state = [t.clone() for sub in opt.subgroups for t in sub.buffers.values()]
        loss_of(model, *batch(0)).backward()  # speculated: the weights on the device changed
        with pytest.raises(RuntimeError, match="set backwards_per_step to the micro-batches per step"):
            loss_of(model, *batch(1)).backward()
        dev.synchronize()
        assert same(before, [p.detach() for p in model.parameters()])  # the old weights are back
        assert same(state[:3], [t for sub in opt.subgroups for t in sub.buffers.values()][:3])
        opt.zero_grad()
        loss_of(model, *batch(0)).backward()  # and training goes on
        opt.step()


def test_zero_grad_without_a_step_takes_the_speculated_weights_back():
    torch.manual_seed(0)
    with device("sim") as dev:
        model = on_sim(Toy(), dev)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=600, speculative=True, **HYPER)
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, *batch(0)).backward()
        opt.zero_grad()
        dev.synchronize()
        assert same(before, [p.detach() for p in model.parameters()])
        assert opt.updates == 0


@pytest.mark.parametrize("options, match", [
    ({"speculative": True, "delay_updates_after": 0}, "speculative and a delayed or hybrid update"),
    ({"speculative": True, "stride": 2}, "speculative and a delayed or hybrid update"),
    ({"speculative": "yes"}, "speculative must be True or False"),
    ({"bucket_numel": 0}, "bucket_numel must be None"),
    ({"backwards_per_step": 0}, "backwards_per_step must be a positive int"),
])
def test_bad_options_are_refused_naming_the_fix(sim, options, match):
    model = on_sim(Toy(), sim)
    with pytest.raises(ValueError, match=match):
        OffloadAdam(model.parameters(), sim, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", VARIANTS)
def test_on_cuda_every_variant_trains_like_the_synchronous_step(variant):
    results = []
    for options in (PLAIN, VARIANTS[variant]):
        torch.manual_seed(0)
        model = Toy().cuda()
        with device("cuda") as dev:
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=300, max_grad_norm=1.0, **options, **HYPER)
            for step in range(3):
                idx, targets = (t.cuda() for t in batch(step))
                keep_gpu_busy()  # the GPU lags the host: a copy or an update not ordered after compute goes wrong
                loss_of(model, idx, targets, use_side=step % 2 == 0).backward()
                keep_gpu_busy()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results, strict=True):  # embedding backward may sum in another order on a GPU: not bitwise
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_worker_runs_with_the_numba_threads_of_the_thread_that_steps(monkeypatch):
    """Numba's thread count is per thread. Lowered on the training thread, it must reach the worker even when
    backward's hooks run on another thread (on a GPU, autograd's device thread, where Numba has its default)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs Numba's default thread count above one")
    seen = []
    adam = speculative.adam_fused_into
    monkeypatch.setattr(speculative, "adam_fused_into",
                        lambda *args, **kwargs: (seen.append(numba.get_num_threads()), adam(*args, **kwargs)))
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        torch.manual_seed(0)
        with device("sim") as dev:
            model = on_sim(Toy(), dev)
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=600, speculative=True, **HYPER)
            for step in range(2):
                loss = loss_of(model, *batch(step))
                backward = threading.Thread(target=loss.backward)  # hooks on a thread at Numba's default
                backward.start()
                backward.join()
                opt.step()
                opt.zero_grad()
    finally:
        numba.set_num_threads(before)
    assert seen and set(seen) == {1}, f"the speculative Adam ran with {sorted(set(seen))} Numba threads, not 1"
