"""The hybrid CPU-GPU update (gpu_fraction, stride): the same training as the CPU-only update, the split model (and
its version with the CPU path's uploads on the same link, and the scratch sets of the streamed path), device memory
refused before anything moves, bad settings named."""

import pytest
import torch
from helpers import HYPER, Toy, assert_resumes_bit_for_bit, batch, fresh, loss_of, on_sim, train

from minioffload import layout
from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.kernels.device_adam import device_adam
from minioffload.predict import hybrid_split
from minioffload.predict.memory import OutOfMemoryError

SPLITS = [{"stride": 1}, {"stride": 2}, {"stride": 3}, {"gpu_fraction": 0.0}, {"gpu_fraction": 0.5},
          {"gpu_fraction": 1.0}]


def run(split, steps=4, micro_batches=1, clip=None, dtype=torch.float32, **options):
    torch.manual_seed(0)
    model = Toy().to(dtype)
    with device("sim", jitter=2e-4, seed=1) as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=300, max_grad_norm=clip,
                          **split, **options, **HYPER)
        losses = train(model, opt, steps, micro_batches, use_side=lambda step: step % 2 == 1)
        masters = [m.clone() for m in opt.master_weights()]
        wheres = [sub.where for sub in opt.subgroups]
    return losses, masters, [p.detach().clone() for p in model.parameters()], wheres


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("micro_batches, clip", [(1, None), (2, 0.5)])
def test_every_split_trains_like_the_cpu_only_update(split, micro_batches, clip):
    cpu_losses, cpu_masters, cpu_weights, _ = run({}, micro_batches=micro_batches, clip=clip)
    losses, masters, weights, wheres = run(split, micro_batches=micro_batches, clip=clip)
    on_device = sum(where != "cpu" for where in wheres)
    expected = {"stride": lambda k: len(range(k - 1, len(wheres), k)),
                "gpu_fraction": lambda f: round(f * len(wheres))}
    (kind, value), = split.items()
    assert on_device == expected[kind](value) and len(wheres) > 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-6)
    for a, b in zip([*masters, *weights], [*cpu_masters, *cpu_weights], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_bf16_model_updated_on_the_device_keeps_fp32_masters():
    _, cpu_masters, cpu_weights, _ = run({}, dtype=torch.bfloat16)
    _, masters, weights, _ = run({"stride": 2}, dtype=torch.bfloat16)
    for a, b in zip(masters, cpu_masters, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(weights, cpu_weights, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)  # 1 bf16 ulp apart at most


def test_the_device_path_moves_12_bytes_per_param_each_way_while_the_cpu_updates():
    torch.manual_seed(0)
    model = Toy(width=64)
    # 16 ms per device-side subgroup: the window for the CPU's share is long against a busy machine's delays
    with device("sim", adam_rate=2.5e5) as dev:
        opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=4096, stride=2)
        dev.synchronize()
        dev.trace.clear()  # from backward on: the first streamed subgroups' state goes in while backward runs
        loss_of(model, *batch(0), use_side=True).backward()  # every parameter gets a gradient
        dev.synchronize()  # a span is traced when its copy ends: count every copy backward queued
        prefetched = sum(s.nbytes for s in dev.trace.on("h2d"))
        opt.step()
        dev.synchronize()
        streamed = sum(sub.numel for sub in opt.subgroups if sub.where == "streamed")
        names = {"master", "exp_avg", "exp_avg_sq"}
        state_in = sum(s.nbytes for s in dev.trace.on("h2d") if s.name.removeprefix("h2d ") in names)
        state_out = sum(s.nbytes for s in dev.trace.on("d2h") if s.name.removeprefix("d2h ") in names)
        device_adam = dev.trace.on("compute")
        cpu_adam = dev.trace.on("cpu")
    assert state_in == state_out == 12 * streamed
    largest = max(sub.numel for sub in opt.subgroups if sub.where == "streamed")
    assert 0 < prefetched <= 12 * opt.device_path.sets * largest  # state of up to `sets` subgroups before step()
    assert device_adam and cpu_adam
    # the CPU does its share while the device path runs (~160 ms here), not after it
    assert max(c.start for c in cpu_adam) < max(a.end for a in device_adam)


def test_a_fraction_that_does_not_fit_is_refused_before_anything_moves():
    torch.manual_seed(0)
    model = Toy(width=64)
    with device("sim", memory_bytes=200_000) as dev:
        on_sim(model, dev)
        used = dev.ledger.used("device")
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(OutOfMemoryError):
            OffloadAdam(model.parameters(), dev, subgroup_numel=4096, gpu_fraction=1.0)
        assert dev.ledger.used("device") == used
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
        loss_of(model, *batch(0)).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p is not model.side.weight
                   and p is not model.side.bias)  # no hook of the refused optimizer took a gradient
        OffloadAdam(model.parameters(), dev, subgroup_numel=4096, gpu_fraction=0.2)  # a smaller share fits


@pytest.mark.parametrize("options, match", [
    ({"gpu_fraction": 1.5}, r"gpu_fraction must be a number in \[0, 1\]"),
    ({"gpu_fraction": -0.1}, r"gpu_fraction must be a number in \[0, 1\]"),
    ({"stride": 0}, "stride must be an int >= 1"),
    ({"stride": 1.5}, "stride must be an int >= 1"),
    ({"gpu_fraction": 0.5, "stride": 2}, "not both"),
    ({"stride": 2, "delay_updates_after": 0}, "do not combine"),
])
def test_bad_splits_are_refused_naming_the_valid_ranges(sim, options, match):
    model = on_sim(Toy(), sim)
    with pytest.raises(ValueError, match=match):
        OffloadAdam(model.parameters(), sim, **options)


def test_the_split_model():
    best = hybrid_split.best_split(cpu_rate=3e8, device_rate=1e8)
    assert best["fraction"] == pytest.approx(0.25) and best["speedup"] == pytest.approx(4 / 3)
    n = 1_000_000  # the model's optimum is where the two paths take equally long, and no fraction beats it
    t_best = hybrid_split.update_time(best["fraction"], n, 3e8, 1e8)
    assert t_best == pytest.approx(n / 3e8 / best["speedup"])
    assert all(hybrid_split.update_time(f / 100, n, 3e8, 1e8) >= t_best * (1 - 1e-12) for f in range(101))
    assert hybrid_split.link_rate(12e9) == pytest.approx(1e9)
    stride = hybrid_split.nearest_stride
    assert stride(0.3) == 3 and stride(1.0) == 1 and stride(0.45) == 2
    assert layout.device_subgroups(10, stride=3) == ([], [2, 5, 8])
    assert layout.device_subgroups(10, gpu_fraction=0.3) == ([7, 8, 9], [])
    with pytest.raises(ValueError, match="rates must be positive"):
        hybrid_split.best_split(0, 1e8)


@pytest.mark.parametrize("weight_bytes", [2, 4])
@pytest.mark.parametrize("cpu_rate", [1e8, 1e9, 3e9, 2e10])
@pytest.mark.parametrize("bandwidth", [4e9, 25e9, 50e9])
def test_the_shared_link_split_is_the_best_of_a_scan(weight_bytes, cpu_rate, bandwidth):
    n = 1_000_000
    best = hybrid_split.best_split_shared(cpu_rate, bandwidth, weight_bytes)
    t_best = hybrid_split.update_time_shared(best["fraction"], n, cpu_rate, bandwidth, weight_bytes)
    scan = [hybrid_split.update_time_shared(f / 10_000, n, cpu_rate, bandwidth, weight_bytes) for f in range(10_001)]
    assert t_best <= min(scan) * (1 + 1e-12)
    assert t_best == pytest.approx(min(scan), rel=1e-3)  # the scan's grid is 1e-4 apart
    assert best["speedup"] == pytest.approx(scan[0] / t_best)
    times = hybrid_split.phase_times(best["fraction"], n, cpu_rate, bandwidth, weight_bytes)
    assert times["d2h"] <= times["h2d"]  # the way up carries the weights as well: it is the busier direction
    if best["fraction"] > 0:  # balanced: the CPU and the way up finish together
        assert times["cpu"] == pytest.approx(times["h2d"])
    # the weights' bytes make the device path dearer than the link-only model says: it gets no more of the work
    assert best["fraction"] <= hybrid_split.best_split(cpu_rate, hybrid_split.link_rate(bandwidth))["fraction"]


def test_the_shared_link_model_counts_each_directions_bytes():
    n, cpu_rate, bandwidth = 1_000_000, 1e9, 12e9
    times = hybrid_split.phase_times(0.25, n, cpu_rate, bandwidth, weight_bytes=2)
    assert times["cpu"] == pytest.approx(0.75 * n / cpu_rate)
    assert times["h2d"] == pytest.approx((0.25 * n * 12 + 0.75 * n * 2) / bandwidth)
    assert times["d2h"] == pytest.approx(0.25 * n * 12 / bandwidth)
    # weights alone keep the link busier than the CPU: nothing goes to the device path
    fast_cpu = hybrid_split.best_split_shared(cpu_rate=1e11, bandwidth=bandwidth, weight_bytes=4)
    assert fast_cpu["fraction"] == 0 and fast_cpu["speedup"] == pytest.approx(1.0)


def _pipeline_time(sets: int, copy: float, adam: float, subgroups: int = 60) -> float:
    """A brute-force run of the streamed path: subgroup i takes scratch set i % sets when that set's last state-out
    copy is done; state in (one direction), device Adam, state out (the other), each stage in order."""
    free, in_end, adam_end, out_end = [0.0] * sets, 0.0, 0.0, 0.0
    for i in range(subgroups):
        in_end = max(in_end, free[i % sets]) + copy
        adam_end = max(adam_end, in_end) + adam
        out_end = max(out_end, adam_end) + copy
        free[i % sets] = out_end
    return out_end


@pytest.mark.parametrize("numel, bandwidth, adam_rate, latency", [
    (1 << 20, 25e9, 1e12, 10e-6),  # the device's Adam far faster than the copies: still three (held 2 copies + Adam)
    (1 << 20, 12e9, 1e9, 0.0),  # Adam exactly as long as a copy: three
    (1 << 20, 12e9, 1.5e9, 0.0),  # Adam a little shorter than a copy: three
    (1 << 22, 50e9, 2e8, 10e-6),  # Adam far longer: two
    (1 << 16, 25e9, 5e10, 1e-3),  # latency-bound copies
])
def test_scratch_sets_keep_the_streamed_pipeline_at_its_slowest_stage(numel, bandwidth, adam_rate, latency):
    sets = hybrid_split.scratch_sets(numel, bandwidth, adam_rate, latency)
    copy, adam = latency + numel * 12 / bandwidth, numel / adam_rate
    enough = _pipeline_time(sets, copy, adam)
    assert sets >= 2 and enough == pytest.approx(_pipeline_time(sets + 8, copy, adam))  # more sets: no faster
    if sets > 2:  # one fewer set and the link waits for a free one (if only for a short Adam per set)
        assert _pipeline_time(sets - 1, copy, adam) - enough > 1e-9


def test_bad_shared_link_inputs_are_refused():
    with pytest.raises(ValueError, match="weight_bytes must be 2"):
        hybrid_split.best_split_shared(1e9, 25e9, weight_bytes=3)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        hybrid_split.update_time_shared(0.5, 1000, 1e9, 0, 2)
    with pytest.raises(ValueError, match="fraction must be in"):
        hybrid_split.phase_times(1.5, 1000, 1e9, 25e9, 2)
    with pytest.raises(ValueError, match="subgroup_numel must be a positive int"):
        hybrid_split.scratch_sets(0, 25e9, 1e10)
    with pytest.raises(ValueError, match="adam_rate must be positive"):
        hybrid_split.scratch_sets(1024, 25e9, float("inf"))


def test_a_checkpoint_of_a_hybrid_run_continues_bit_for_bit():
    assert_resumes_bit_for_bit(lambda dev, name: fresh(dev, stride=2))


@pytest.mark.parametrize("split", [{"stride": 2}, {"gpu_fraction": 0.5}], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_every_split_trains_like_the_cpu_only_update(split):
    results = []
    for options in ({}, split):
        torch.manual_seed(0)
        model = Toy().cuda()
        with device("cuda") as dev:
            opt = OffloadAdam(model.parameters(), dev, subgroup_numel=300, **options, **HYPER)
            for step in range(3):
                idx, targets = (t.cuda() for t in batch(step))
                loss_of(model, idx, targets).backward()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            results.append([m.cpu() for m in opt.master_weights()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cupy_kernel_matches_torch_fused_adamw():
    pytest.importorskip("cupy")
    from minioffload.kernels.gpu_adam import adam_cupy

    g = torch.Generator(device="cuda").manual_seed(0)
    p, grad, m, v = (torch.randn(1 << 20, device="cuda", generator=g) for _ in range(4))
    v.abs_()
    ours = [t.clone() for t in (p, grad, m, v)]
    for step in range(1, 4):
        adam_cupy(ours[0], ours[1], ours[2], ours[3], step=step, lr=1e-3, weight_decay=0.01)
        device_adam(p, grad, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for a, b in zip(ours, (p, grad, m, v), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_brought_in_during_backward_follows_a_loaded_checkpoint():
    """Backward brings the first streamed subgroups' state in before step(). A backward that ends in zero_grad()
    leaves that state valid; a checkpoint loaded after it must replace it, or the step updates the old state. The load
    writes the pinned state those copies read: it declares the write, so the strict sim raises in every run if the
    host does not wait for them first."""
    def train(steps, discard=False, roll_back_at=None):
        torch.manual_seed(0)
        model = Toy(width=64)
        with device("sim", adam_rate=1e7, jitter=1e-4, seed=3) as dev:
            opt = OffloadAdam(on_sim(model, dev).parameters(), dev, subgroup_numel=4096, stride=1, **HYPER)
            saved = None
            for step in steps:
                if roll_back_at is not None and step == roll_back_at - 1:
                    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
                if discard:
                    loss_of(model, *batch(50 + step), use_side=True).backward()  # brings state in; no step
                    if step == roll_back_at:  # back to before the last step, after the prefetch
                        model.load_state_dict(saved[0])
                        opt.load_state_dict(saved[1])
                    opt.zero_grad()
                loss_of(model, *batch(step), use_side=True).backward()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            return [p.detach().clone() for p in model.parameters()], opt.device_path.sets

    plain, sets = train([0, 1, 2, 3])
    assert sets >= 2
    assert all(torch.equal(a, b) for a, b in zip(plain, train([0, 1, 2, 3], discard=True)[0], strict=True))
    skipped_2, _ = train([0, 1, 3])
    rolled_back, _ = train([0, 1, 2, 3], discard=True, roll_back_at=3)  # step 2 undone after step 3's prefetch
    assert all(torch.equal(a, b) for a, b in zip(skipped_2, rolled_back, strict=True))
