"""The step model's composition rules on hand-made hardware: steps bound by compute, the link, the CPU, the disk;
overlaps the runtime has (delayed update, hybrid split, bucketed copies, speculative update), the shared host of the
sim, and the lower bound."""

import dataclasses
from itertools import pairwise

import pytest

from minioffload.machine import profiles
from minioffload.options import OffloadOptions, Placement
from minioffload.predict import stepmodel
from minioffload.predict.step_config import pack_buckets
from minioffload.predict.stepmodel import StepConfig, Workload

N, T = 1_000_000, 1000  # 6 N T = 6e9 FLOP per step


def machine(**changes) -> profiles.Hardware:
    """Round numbers: 1e11 FLOP/s at mfu 1 (forward 20 ms, backward 40 ms), links 1 GB/s, host 100 GB/s, CPU Adam
    1e9 params/s (1 ms for N), disk 1 GB/s each way; no latency, launch or per-call cost unless asked."""
    figures = dict(device_memory=1e10, device_bandwidth=1e12, peak_flops_bf16=1e11, peak_flops_fp32=1e11,
                   device_adam_rate=1e10, link_theoretical=1e9, link_h2d=1e9, link_d2h=1e9, link_latency=0.0,
                   copy_overhead=0.0, grad_hook_overhead=0.0, subgroup_overhead=0.0, fetch_overhead=0.0,
                   pack_overhead=0.0, host_memory=1e11, host_bandwidth=1e11,
                   cpu_adam_rate=1e9, nvme_read=1e9, nvme_write=1e9, nvme_read_overhead=0.0, nvme_write_overhead=0.0,
                   cores=8, interconnect=1e9, collective_latency=0.0, gpus_per_node=8)
    figures.update(changes)
    zero_ok = {k: max(v, 1e-30) for k, v in figures.items()}  # latency 0 is "none": the profile wants > 0
    return profiles.Hardware(name="test", description="hand-made", sources=dict.fromkeys(profiles.FIGURES, "test"),
                             **zero_ok)


def step(hw, **config):
    return stepmodel.predict(Workload(N, T, "fp32", num_tensors=1), hw, StepConfig(mfu=1.0, **config))


def test_on_device_step_is_forward_backward_and_device_adam():
    pred = step(machine(), optimizer_on="device")
    assert pred.step_s == pytest.approx(0.060 + N / 1e10)
    assert pred.bound == "compute" and not pred.exposed


def test_compute_bound_offload_exposes_only_what_must_follow_backward():
    pred = step(machine(link_h2d=1e12, link_d2h=1e12, cpu_adam_rate=1e12, host_bandwidth=1e13))
    assert pred.bound == "compute"
    assert pred.step_s == pytest.approx(0.060, rel=1e-3)


def test_link_bound_step_adds_both_copies_in_series_with_one_subgroup():
    # one subgroup and one tensor: the gradient leaves after backward, the weights return after the update
    pred = step(machine(link_h2d=1e8, link_d2h=1e8))  # 4 MB each way: 40 ms each
    host = N * (stepmodel.ACCUMULATE_BYTES + 4 + stepmodel.ZERO_BYTES) / 1e11
    assert pred.step_s == pytest.approx(0.060 + 0.040 + host + N / 1e9 + 0.040)
    assert pred.exposed["d2h"] == pytest.approx(0.040) and pred.exposed["h2d"] == pytest.approx(0.040)


def test_many_subgroups_hide_the_upload_behind_the_update():
    hw = machine(link_h2d=1e8, link_d2h=1e8)
    work = Workload(N, T, "fp32", num_tensors=100)
    one = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N))
    many = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 10))
    assert many.step_s < one.step_s
    # gradients of later subgroups leave during the backward of earlier layers
    assert many.exposed["d2h"] < one.exposed["d2h"]


def test_cpu_bound_delayed_update_takes_the_updates_time_per_step():
    hw = machine(cpu_adam_rate=1e7)  # the update: 100 ms, longer than forward + backward
    sync, delayed = step(hw), step(hw, delay_updates_after=0)
    assert sync.bound == delayed.bound == "cpu"
    assert sync.step_s == pytest.approx(0.060 + 0.004 + 0.100 + 0.004, rel=0.02)  # fwd+bwd, d2h, Adam, h2d
    assert delayed.step_s == pytest.approx(0.100 + 0.004, rel=0.05)  # the update (and the weights' upload) per step
    assert delayed.step_s < sync.step_s


def test_delayed_update_hides_a_short_update_completely():
    hw = machine(link_h2d=1e10, link_d2h=1e10, cpu_adam_rate=1e8)  # update 10 ms < forward + backward
    delayed = step(hw, delay_updates_after=0)
    assert delayed.step_s == pytest.approx(0.060, rel=0.05)
    assert delayed.exposed["cpu"] == pytest.approx(0.0, abs=1e-3)


def test_a_shared_host_runs_compute_and_the_cpu_update_one_after_the_other():
    hw = machine(link_h2d=1e10, link_d2h=1e10, cpu_adam_rate=1e8)
    shared = dataclasses.replace(hw, shared_host=True)
    assert step(shared, delay_updates_after=0).step_s == pytest.approx(
        step(hw, delay_updates_after=0).step_s + 0.010, rel=0.05)
    assert step(shared, delay_updates_after=0).bound == "host"


def test_disk_bound_step_pays_reads_and_writes_on_one_drive():
    hw = machine(nvme_read=1e8, nvme_write=1e8, link_h2d=1e10, link_d2h=1e10)
    pred = step(hw, optimizer_on="nvme")  # 12 MB of state each way: 120 ms read + 120 ms write, one drive
    assert pred.bound == "nvme"
    assert pred.busy["nvme_read"] == pytest.approx(0.120) and pred.busy["nvme_write"] == pytest.approx(0.120)
    # the last write drains during the next forward and backward (the runtime waits for it only when its
    # working set is needed again): the drive, busy reading then writing, is the step
    assert pred.step_s == pytest.approx(0.240, rel=0.02)


def test_hybrid_split_moves_work_from_the_cpu_to_the_device_path():
    hw = machine(cpu_adam_rate=1e7, link_h2d=1e10, link_d2h=1e10)
    work = Workload(N, T, "fp32", num_tensors=30)
    cpu_only = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 30))
    split = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 30, stride=3))
    static = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 30, gpu_fraction=0.5))
    assert split.busy["cpu"] == pytest.approx(cpu_only.busy["cpu"] * 2 / 3, rel=0.05)
    assert static.busy["cpu"] == pytest.approx(cpu_only.busy["cpu"] / 2, rel=0.05)
    assert split.step_s < cpu_only.step_s and static.step_s < split.step_s


def test_recompute_adds_a_forward():
    base = stepmodel.predict(Workload(N, T, "fp32"), machine(), StepConfig(optimizer_on="device", mfu=1.0))
    again = stepmodel.predict(Workload(N, T, "fp32", recompute=True), machine(),
                              StepConfig(optimizer_on="device", mfu=1.0))
    assert again.step_s - base.step_s == pytest.approx(0.020)


def test_presets_predict_a_7b_offloaded_step():
    work = Workload(7_000_000_000, 8 * 4096, num_tensors=291)
    for name in profiles.PRESETS:
        pred = stepmodel.predict(work, profiles.preset(name), StepConfig(subgroup_numel=100_000_000))
        assert pred.step_s > 6 * 7e9 * 8 * 4096 / profiles.preset(name).peak_flops_bf16
        assert pred.bound in ("compute", "cpu", "d2h", "h2d")
        assert pred.trace.spans and "compute" in pred.busy


@pytest.mark.parametrize("bad, match", [
    (dict(delay_updates_after=0, stride=2), "choose one"),
    (dict(optimizer_on="device", stride=2), "offload the optimizer, optimizer_on='host'"),
    (dict(optimizer_on="gpu"), "optimizer_on must be one of 'device', 'host', 'nvme', got 'gpu'"),
    (dict(mfu=0), "mfu"),
    (dict(stride=0), "stride"),
    (dict(gpu_fraction=1.5), "gpu_fraction"),
])
def test_bad_configurations_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        StepConfig(**bad)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="num_params"):
        Workload(0, 10)
    with pytest.raises(ValueError, match="unknown precision"):
        Workload(10, 10, "fp8")
    with pytest.raises(TypeError, match="profiles.Hardware"):
        stepmodel.predict(Workload(10, 10), "h100-sxm")


def test_compare_reports_ratio_and_error():
    pred = step(machine(), optimizer_on="device")
    row = stepmodel.compare(pred, pred.step_s * 2)
    assert row["ratio"] == pytest.approx(0.5) and row["relative_error"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="measured_step_s"):
        stepmodel.compare(pred, 0)


def test_host_dram_shared_by_dma_and_the_cpu_bounds_the_step():
    # a slow host memory: the CPU's passes and the copies' DMA cannot all fit in the scheduled step
    hw = machine(host_bandwidth=1e8, cpu_adam_rate=1e10, link_h2d=1e10, link_d2h=1e10)
    pred = step(hw)
    per_param = stepmodel.ACCUMULATE_BYTES + 4 + 28 + stepmodel.ZERO_BYTES + 4 + 4  # passes + d2h + h2d DMA
    assert pred.host_memory_s == pytest.approx(N * per_param / 1e8)
    assert pred.bound == "host memory" and pred.step_s >= pred.host_memory_s
    # the update phase (after the gradients arrived) moves all but the d2h copies' bytes after backward
    update_bytes = N * (per_param - 4)
    entry = max(s.end for s in pred.trace.spans if s.lane == "d2h")
    assert pred.step_s == pytest.approx(entry + update_bytes / 1e8)


def test_the_update_phase_alone_is_bounded_by_its_host_memory_traffic():
    # fast compute hides little of a synchronous update: streaming the state (24 B/param of DMA) can be no
    # faster than host memory allows, even when the link could go faster; only the state of the first subgroups
    # whose gradients exist (one per scratch set) comes in during backward
    from minioffload.predict.hybrid_split import scratch_sets

    hw = machine(host_bandwidth=1e9, link_h2d=1e11, link_d2h=1e11, cpu_adam_rate=1e12, device_adam_rate=1e12)
    work = Workload(N, T, "fp32", num_tensors=10)
    pred = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 10, stride=1))
    assert pred.bound == "host memory"
    backward_end = max(s.end for s in pred.trace.spans if s.name == "backward")
    early = scratch_sets(N // 10, hw.link_h2d, hw.device_adam_rate, hw.link_latency) * N // 10
    assert 0 < early < N
    assert pred.step_s - backward_end >= (N * 12 + (N - early) * 12) / 1e9 * (1 - 1e-9)
    first_in = min(s.start for s in pred.trace.spans if s.name == "h2d state")
    assert first_in < backward_end  # some state went in during backward


# --- streamed parameters (chapter 8) ---------------------------------------------------------------

LAYERS, HEAD = 10, N // 10  # ten blocks of 90_000 parameters and a resident head of 100_000
STREAMED = Workload(N, T, "fp32", num_tensors=40, num_layers=LAYERS, resident_params=HEAD)


def streamed(hw, **config):
    return stepmodel.predict(STREAMED, hw, StepConfig(mfu=1.0, **config))


def test_gradients_on_nvme_add_their_write_and_read_to_the_drive():
    """Each subgroup's fp32 gradient goes to the drive after backward (4 B/param) and comes back with its state
    (16 B/param read); the state alone is written back (12 B/param). A slow drive: the step grows by those bytes."""
    hw = machine(nvme_read=1e8, nvme_write=1e8, link_h2d=1e10, link_d2h=1e10)
    host, nvme = step(hw, optimizer_on="nvme"), step(hw, optimizer_on="nvme", grads_on="nvme")
    assert lane_bytes(nvme, "nvme_read") == 16 * N and lane_bytes(host, "nvme_read") == 12 * N
    assert lane_bytes(nvme, "nvme_write", "nvme write grad") == 4 * N
    assert lane_bytes(nvme, "nvme_write") - lane_bytes(host, "nvme_write") == 4 * N  # the state's writes alike
    assert nvme.bound == "nvme" and nvme.step_s == pytest.approx(host.step_s + 8 * N / 1e8, rel=0.05)


def lane_bytes(pred, lane, prefix=""):
    return sum(s.nbytes for s in pred.trace.spans if s.lane == lane and s.name.startswith(prefix))


@pytest.mark.parametrize("home", ["host", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_streamed_weights_cross_the_link_twice_per_step_and_are_not_uploaded_after_it(home, prefetch):
    pred = streamed(machine(), params_on=home, prefetch=prefetch)
    block = (N - HEAD) // LAYERS * 4  # fp32 weights of one block
    # forward and backward fetch every block, except the last (k + 1) // 2, whose backward comes within k uses of
    # their forward (model/streaming.py keeps them); no upload after the update
    fetched = 2 * LAYERS - (prefetch + 1) // 2
    assert lane_bytes(pred, "h2d") == fetched * block
    assert lane_bytes(pred, "nvme_read") == (fetched * block if home == "nvme" else 0)
    assert lane_bytes(pred, "d2h") == N * 4  # every gradient still leaves once
    # after the update the weights go home: on NVMe, written (all of them: the optimizer updates the head too)
    assert lane_bytes(pred, "nvme_write", "nvme write weights") == (N * 4 if home == "nvme" else 0)


def test_streamed_update_rounds_into_the_host_home_and_issues_no_upload():
    hw = machine(copy_overhead=1e-3)
    on_device = stepmodel.predict(Workload(N, T, num_tensors=40), hw, StepConfig(mfu=1.0))
    home = stepmodel.predict(Workload(N, T, num_tensors=40, num_layers=LAYERS, resident_params=HEAD), hw,
                             StepConfig(mfu=1.0, params_on="host"))
    rounding = [s.duration for p in (on_device, home) for s in p.trace.spans if s.name == "round + zero grad"]
    # bf16: the same pass (read 4, write 2, zero 4 B/param), without the host time to issue the one subgroup's upload
    # (one copy per subgroup, not per tensor: issue 19)
    assert rounding[1] == pytest.approx(N * (4 + 2 + stepmodel.ZERO_BYTES) / 1e11)
    assert rounding[0] == pytest.approx(rounding[1] + 1e-3)


def test_depth_zero_exposes_every_fetch():
    for home in ("host", "nvme"):
        for link in (1e12, 1e9, 1e7):
            pred = streamed(machine(link_h2d=link, link_d2h=link), params_on=home, prefetch=0)
            assert pred.fetch_s > 0 and pred.exposed_fetch_fraction == pytest.approx(1.0), (home, link)


def test_deeper_prefetch_never_predicts_a_longer_step():
    for home in ("host", "nvme"):
        for link in (1e12, 1e9, 1e8, 3e7, 1e6):
            hw = machine(link_h2d=link, link_d2h=link, nvme_read=link / 2)
            steps = [streamed(hw, params_on=home, prefetch=k).step_s for k in range(6)]
            assert all(b <= a * (1 + 1e-9) for a, b in pairwise(steps)), (home, link, steps)
            assert steps[2] < steps[0]


def test_a_fast_link_hides_the_fetches_and_a_slow_one_exposes_them():
    fast = streamed(machine(link_h2d=1e11, link_d2h=1e11), params_on="host", prefetch=2)
    # only the first block's forward fetch has nothing to hide under: 1 of 2 x LAYERS - 1 fetches
    assert fast.exposed_fetch_fraction == pytest.approx(1 / (2 * LAYERS - 1), rel=0.05)
    assert 0.060 < fast.step_s < 0.0625 and fast.bound == "compute"  # forward, backward, the 1 ms update
    slow = streamed(machine(link_h2d=1e6, link_d2h=1e6), params_on="host", prefetch=2)
    assert slow.exposed_fetch_fraction > 0.99 and slow.bound == "h2d"


def test_streaming_moves_no_flop():
    plain = step(machine(link_h2d=1e12, link_d2h=1e12))
    for home in ("host", "nvme"):
        pred = streamed(machine(link_h2d=1e12, link_d2h=1e12), params_on=home)
        assert pred.busy["compute"] == pytest.approx(plain.busy["compute"])
        names = [s.name for s in pred.trace.spans if s.lane == "compute"]
        assert names.index("forward block 9") < names.index("forward head") < names.index("backward block 9") \
            < names.index("backward block 0")


def test_params_on_device_predicts_what_it_did_before_streaming_existed():
    # values computed by the step model before chapter 8 added params_on (same workloads, same presets)
    # (with the engine's per-gradient and per-subgroup costs, added since, at nothing)
    h100_hw = profiles.preset("h100-sxm")
    no_hooks = h100_hw.replace(grad_hook_overhead=1e-30, subgroup_overhead=1e-30)
    h100 = stepmodel.predict(Workload(7_000_000_000, 8 * 4096, num_tensors=291), no_hooks)
    assert h100.step_s == pytest.approx(10.6452207916231, rel=1e-12)
    # each of the 291 gradients' hooks takes grad_hook_overhead of the backward's thread
    hooked = stepmodel.predict(Workload(7_000_000_000, 8 * 4096, num_tensors=291), no_hooks.replace(
        grad_hook_overhead=h100_hw.grad_hook_overhead))
    assert hooked.step_s - h100.step_s == pytest.approx(291 * h100_hw.grad_hook_overhead, rel=1e-6)
    # and each subgroup's update subgroup_overhead of the CPU's (a tensor of 24M elements is a subgroup of its own;
    # the step is bound by the CPU, so all 291 lengthen it)
    both = stepmodel.predict(Workload(7_000_000_000, 8 * 4096, num_tensors=291), h100_hw)
    assert both.bound == "cpu"
    assert both.step_s - hooked.step_s == pytest.approx(291 * h100_hw.subgroup_overhead, rel=1e-6)
    config = StepConfig(optimizer_on="nvme", max_grad_norm=1.0, subgroup_numel=50_000_000)
    rtx4090 = profiles.preset("rtx4090").replace(grad_hook_overhead=1e-30, subgroup_overhead=1e-30)
    rtx = stepmodel.predict(Workload(1_300_000_000, 4096, "fp32", 150, True), rtx4090, config)
    # since issue 19 the weights go up in one copy per subgroup (5 tensors here): the last upload, which nothing
    # hides, pays 4 fewer latencies and the host issues 4 fewer copies
    fewer_copies = 4 * (rtx4090.link_latency + rtx4090.copy_overhead)
    no_file_costs = rtx4090.replace(nvme_read_overhead=1e-30, nvme_write_overhead=1e-30)
    before = stepmodel.predict(Workload(1_300_000_000, 4096, "fp32", 150, True), no_file_costs, config)
    assert before.step_s == pytest.approx(6.032538235304857 - fewer_copies, rel=1e-12) and rtx.bound == "nvme"
    # since issue 32 each subgroup's state file, read and written once a step on the drive that bounds the step, adds
    # its fixed costs (all but the reads the next step's start overlaps)
    files = len(Workload(1_300_000_000, 4096, "fp32", 150, True).subgroups(50_000_000))
    per_file = rtx4090.nvme_read_overhead + rtx4090.nvme_write_overhead
    assert (files - 2) * per_file <= rtx.step_s - before.step_s <= files * per_file
    # the block structure and the prefetch depth mean nothing while the weights are resident
    layered = stepmodel.predict(Workload(7_000_000_000, 8 * 4096, num_tensors=291, num_layers=32,
                                         resident_params=10**8), profiles.preset("h100-sxm"), StepConfig(prefetch=4))
    assert layered.step_s == both.step_s and layered.fetch_s == 0 and layered.exposed_fetch_fraction == 0


def test_workload_of_a_gpt_counts_its_blocks():
    from minioffload.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset("small", vocab_size=74))
    work = Workload.of(model, 128)
    in_blocks = sum(p.numel() for p in model.blocks.parameters())
    assert work.num_layers == 6 and work.resident_params == work.num_params - in_blocks
    assert work.block_params == in_blocks / 6
    plain = Workload.of(torch_linear(), 128)
    assert plain.num_layers == 1 and plain.resident_params == 0


def torch_linear():
    import torch

    return torch.nn.Linear(4, 4)


@pytest.mark.parametrize("bad, match", [
    (dict(prefetch=-1), "prefetch must be an int >= 0"),
    (dict(prefetch=1.5), "prefetch must be an int >= 0"),
    (dict(prefetch=True), "prefetch must be an int >= 0"),
    (dict(params_on="gpu"), "params_on must be one of 'device', 'host', 'nvme', got 'gpu'"),
    (dict(params_on="host", optimizer_on="device"), "streams weights that the CPU optimizer updates"),
    (dict(params_on="nvme", delay_updates_after=0), "synchronous CPU update only"),
    (dict(params_on="host", stride=2), "synchronous CPU update only"),
])
def test_bad_streaming_configurations_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        StepConfig(**bad)


def test_bad_block_structures_are_refused():
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        Workload(N, T, num_layers=0)
    with pytest.raises(ValueError, match=r"resident_params must be in \[0, num_params\)"):
        Workload(N, T, resident_params=N)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_a_fetch_starts_when_the_block_k_plus_one_uses_back_has_computed(prefetch):
    # a fast link: a fetch starts as soon as the window lets it, not when the link is free
    pred = streamed(machine(link_h2d=1e12, link_d2h=1e12), params_on="host", prefetch=prefetch)
    spans = sorted(pred.trace.spans, key=lambda s: s.start)
    fetches = [s for s in spans if s.name.startswith("fetch block")]
    computes = [s for s in spans if s.name.startswith(("forward block", "backward block"))]
    assert len(computes) == 2 * LAYERS and len(fetches) == 2 * LAYERS - (prefetch + 1) // 2
    fetched = [c for c in computes if not (c.name.startswith("backward")
                                           and 2 * (LAYERS - 1 - int(c.name.split()[-1])) < prefetch)]
    for fetch, compute in zip(fetches, fetched, strict=True):
        v = computes.index(compute)
        assert fetch.end <= compute.start + 1e-12  # a block computes once its weights are there
        if prefetch == 0:  # on demand: once whatever came before (the head included) has computed
            before = max((s.end for s in spans if s.lane == "compute" and s.end <= compute.start), default=0.0)
            assert fetch.start == pytest.approx(before, abs=1e-9)
        elif v > prefetch:  # the window: when the (k + 1)-th use back is done
            assert fetch.start == pytest.approx(computes[v - prefetch - 1].end, abs=1e-9)
        else:  # the first k + 1 fetches start with the step
            assert fetch.start < computes[0].end


# --- bucketed gradient copies, the speculative update, the lower bound (issue 19) ----------------------------------

SMALL = Workload(N, T, "fp32", num_tensors=100)  # 100 tensors of 10_000, ten per subgroup of 100_000


def small(hw, **config):
    return stepmodel.predict(SMALL, hw, StepConfig(mfu=1.0, subgroup_numel=N // 10, **config))


def test_buckets_pack_consecutive_tensors_and_a_large_one_alone():
    assert pack_buckets([5, 1, 1, 20, 2, 2], 6) == [[5, 1], [1], [20], [2, 2]]
    assert pack_buckets([3, 3, 3], 6) == [[3, 3], [3]]
    assert pack_buckets([7], 6) == [[7]]


@pytest.mark.parametrize("bucket_numel, buckets_per_subgroup", [(35_000, 4), (100_000, 1), (10_000, 10), (5_000, 10)])
def test_bucketed_gradients_pay_one_latency_per_bucket(bucket_numel, buckets_per_subgroup):
    latency = 1e-4
    hw = machine(link_latency=latency)
    per_tensor, bucketed = small(hw), small(hw, bucket_numel=bucket_numel)
    d2h_bytes = N * 4 / 1e9
    assert per_tensor.busy["d2h"] == pytest.approx(d2h_bytes + 100 * latency)  # a copy per tensor
    assert bucketed.busy["d2h"] == pytest.approx(d2h_bytes + 10 * buckets_per_subgroup * latency)
    assert bucketed.step_s <= per_tensor.step_s * (1 + 1e-9)


def test_buckets_trade_the_hooks_copies_for_a_gather_on_the_device():
    hw = machine(copy_overhead=1e-4, device_bandwidth=1e11)
    per_tensor, bucketed = small(hw), small(hw, bucket_numel=50_000)  # 2 buckets per subgroup: 20 copies, not 100
    gather = 2 * N * 4 / 1e11  # every gradient read and written once on the device
    assert per_tensor.busy["compute"] - bucketed.busy["compute"] == pytest.approx((100 - 20) * 1e-4 - gather)
    assert bucketed.step_s < per_tensor.step_s


def test_a_bucket_leaves_when_its_last_gradient_is_ready():
    hw = machine(link_h2d=1e10, link_d2h=1e10)
    per_tensor, bucketed = small(hw), small(hw, bucket_numel=20_000)
    first_copy = [min(s.start for s in p.trace.spans if s.name == "d2h grad") for p in (per_tensor, bucketed)]
    backward_per_param = 0.040 / N
    assert first_copy[0] == pytest.approx(0.020 + backward_per_param * 100_000)  # the whole last subgroup
    gather = 2 * 20_000 * 4 / hw.device_bandwidth
    assert first_copy[1] == pytest.approx(0.020 + backward_per_param * 20_000 + gather)  # its last bucket only


def test_streamed_gradients_are_bucketed_too():
    hw = machine(link_latency=1e-4)
    per_tensor = streamed(hw, params_on="host")
    bucketed = streamed(hw, params_on="host", bucket_numel=N)  # every block's (and the head's) tensors in one copy
    copies = [round((p.busy["d2h"] - N * 4 / 1e9) / 1e-4) for p in (per_tensor, bucketed)]
    # per tensor: each block's 90_000 parameters as 4 tensors (40 tensors of 25_000 on average), the head as 1
    assert copies == [LAYERS * 4 + 1, LAYERS + 1]


def test_the_weights_go_up_in_one_copy_per_subgroup():
    latency = 1e-4
    for delay in (False, True):
        pred = small(machine(link_latency=latency), delay_updates_after=0 if delay else None)
        assert pred.busy["h2d"] == pytest.approx(N * 4 / 1e9 + 10 * latency), delay  # ten subgroups, 100 tensors


def test_a_speculative_update_runs_during_backward():
    hw = machine(cpu_adam_rate=2.5e7)  # the update (40 ms) as long as backward
    sync, speculative = small(hw), small(hw, speculative=True)
    backward_end = max(s.end for s in speculative.trace.spans if s.name == "backward")
    adams = sorted(s.start for s in speculative.trace.spans if s.name.startswith("adam"))
    assert len(adams) == 10 and adams[0] < backward_end and adams[-2] < backward_end
    assert speculative.step_s < 0.8 * sync.step_s
    # what is left after backward: the first-arrived subgroup's gradient copy then its update, not all ten
    adam_s = 0.040 / 10
    assert speculative.step_s - backward_end < 3 * adam_s < sync.step_s - max(s.end for s in sync.trace.spans
                                                                                 if s.name == "backward")


def test_a_tiny_update_gains_nothing_from_speculation():
    hw = machine(cpu_adam_rate=1e12, host_bandwidth=1e13, link_h2d=1e12, link_d2h=1e12)
    sync, speculative = small(hw), small(hw, speculative=True)
    assert speculative.step_s == pytest.approx(sync.step_s, rel=1e-3)
    assert sync.step_s == pytest.approx(0.060, rel=1e-3)


def test_speculative_clipping_costs_the_norms_read_and_a_validation_after_backward():
    hw = machine(cpu_adam_rate=2.5e7)
    plain, clipped = small(hw, speculative=True), small(hw, speculative=True, max_grad_norm=1.0)
    # the norm's read as the gradients are added in (4 B/param); the coefficient's pass only when it clips (a redo)
    assert clipped.busy["cpu"] - plain.busy["cpu"] == pytest.approx(N * 4 / 1e11)
    sync_plain, sync_clipped = small(hw), small(hw, max_grad_norm=1.0)
    assert sync_clipped.busy["cpu"] - sync_plain.busy["cpu"] == pytest.approx(N * stepmodel.CLIP_BYTES / 1e11)
    assert clipped.step_s < sync_clipped.step_s


CONFIGS = [dict(), dict(max_grad_norm=1.0), dict(delay_updates_after=0), dict(stride=2), dict(gpu_fraction=0.5),
           dict(optimizer_on="nvme"), dict(optimizer_on="device"), dict(bucket_numel=30_000),
           dict(speculative=True, max_grad_norm=1.0), dict(speculative=True, optimizer_on="nvme"),
           dict(ranks=2, max_grad_norm=1.0), dict(params_on="host", prefetch=2),
           dict(params_on="nvme", bucket_numel=50_000)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("hw", [machine(), machine(cpu_adam_rate=1e7), machine(link_h2d=1e8, link_d2h=1e8),
                                machine(host_bandwidth=1e8), machine(nvme_read=1e7, nvme_write=1e7),
                                dataclasses.replace(machine(cpu_adam_rate=1e8), shared_host=True),
                                profiles.preset("h100-sxm")], ids=range(7))
def test_the_lower_bound_is_the_busiest_resource_and_never_above_the_step(hw, config):
    work = Workload(N, T, "fp32", num_tensors=40, num_layers=LAYERS, resident_params=HEAD)
    pred = stepmodel.predict(work, hw, StepConfig(mfu=1.0, subgroup_numel=N // 10, **config))
    assert 0 < pred.lower_bound_s <= pred.step_s * (1 + 1e-12)
    assert pred.lower_bound_s == max([*pred.resource_busy.values(), pred.host_memory_s])
    named = pred.host_memory_s if pred.lower_bound == "host memory" else pred.resource_busy[pred.lower_bound]
    assert named == pred.lower_bound_s


def test_the_lower_bound_on_simple_steps():
    on_device = step(machine(), optimizer_on="device")  # compute alone: the step is its bound
    assert on_device.lower_bound_s == pytest.approx(on_device.step_s) and on_device.lower_bound == "compute"
    disk = step(machine(nvme_read=1e8, nvme_write=1e8, link_h2d=1e10, link_d2h=1e10), optimizer_on="nvme")
    assert disk.lower_bound == "nvme" and disk.lower_bound_s == pytest.approx(0.240)  # reads + writes, one drive
    cpu = step(machine(cpu_adam_rate=1e7))  # a synchronous update: the CPU busy 100 ms, the step waits for more
    assert cpu.lower_bound == "cpu" and cpu.lower_bound_s == pytest.approx(cpu.busy["cpu"])
    assert cpu.lower_bound_s < cpu.step_s - 0.050
    dram = step(machine(host_bandwidth=1e8, cpu_adam_rate=1e10, link_h2d=1e10, link_d2h=1e10))
    assert dram.lower_bound == "host memory" and dram.lower_bound_s == pytest.approx(dram.host_memory_s)
    shared = step(dataclasses.replace(machine(cpu_adam_rate=1e8), shared_host=True))
    assert shared.lower_bound == "host" and shared.lower_bound_s == pytest.approx(shared.busy["compute"]
                                                                                  + shared.busy["cpu"])


def test_step_config_is_a_placement_and_the_engines_options():
    options = OffloadOptions(bucket_numel=1 << 16, speculative=True, max_grad_norm=1.0)
    config = StepConfig(options=options)
    assert config.options == options and config.placement == Placement() and config.mfu == 0.4
    assert StepConfig(bucket_numel=1 << 16, speculative=True, max_grad_norm=1.0) == config
    assert StepConfig(Placement(optimizer_on="nvme"), mfu=0.5) == StepConfig(optimizer_on="nvme", mfu=0.5)
    assert config.replace(ranks=2, speculative=False).placement.ranks == 2
    with pytest.raises(TypeError, match="unknown setting.*delay.*Placement has"):
        StepConfig(delay=True)


@pytest.mark.parametrize("bad, match", [
    (dict(speculative=True, delay_updates_after=0), "speculative and a delayed or hybrid update"),
    (dict(speculative=True, stride=2), "speculative and a delayed or hybrid update"),
    (dict(speculative=True, gpu_fraction=0.5), "speculative and a delayed or hybrid update"),
    (dict(speculative=True, ranks=2), "sharded, ranks=2 .train: shard., runs the synchronous CPU update"),
    (dict(speculative=True, params_on="host"), "speculative=True uploads the new weights, and streamed weights"),
    (dict(speculative="yes"), "speculative must be True or False"),
    (dict(bucket_numel=0), "bucket_numel must be None"),
    (dict(bucket_numel=2.5), "bucket_numel must be None"),
    (dict(optimizer_on="device", bucket_numel=1024), "bucket_numel is an option of the offloaded optimizer"),
    (dict(optimizer_on="device", speculative=True), "speculative is an option of the offloaded optimizer"),
    (dict(optimizer_on="device", delay_updates_after=0, stride=None, bucket_numel=8),
     "delay_updates_after, bucket_numel are options of the offloaded optimizer"),
])
def test_bad_issue_19_configurations_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        StepConfig(**bad)


def test_each_mechanism_pays_its_fixed_cost_once_per_call():
    """fetch_overhead once per block fetched, on the compute lane; a file's read or write cost once per file on the
    drive; collective_latency once per collective on the interconnect."""
    def busy_grows(lane, base, changed, per_call, count_of):
        calls = count_of(base)
        assert calls > 0 and changed.busy[lane] - base.busy[lane] == pytest.approx(calls * per_call, rel=1e-9)

    def spans(prefix, lane=None):
        return lambda pred: sum(1 for s in pred.trace.spans if s.name.startswith(prefix) and lane in (None, s.lane))

    fetched = streamed(machine(), params_on="host")
    busy_grows("compute", fetched, streamed(machine(fetch_overhead=1e-3), params_on="host"), 1e-3,
               spans("fetch block"))
    from_disk = streamed(machine(), params_on="nvme", optimizer_on="nvme")
    busy_grows("nvme_read", from_disk, streamed(machine(nvme_read_overhead=1e-3), params_on="nvme",
                                                optimizer_on="nvme"), 1e-3, spans("", "nvme_read"))
    busy_grows("nvme_write", from_disk, streamed(machine(nvme_write_overhead=1e-3), params_on="nvme",
                                                 optimizer_on="nvme"), 1e-3, spans("", "nvme_write"))
    two = step(machine(), ranks=2, max_grad_norm=1.0)
    busy_grows("net", two, step(machine(collective_latency=1e-3), ranks=2, max_grad_norm=1.0), 1e-3,
               spans("", "net"))
