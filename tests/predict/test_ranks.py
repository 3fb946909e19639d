"""Sharded offload on paper (issue 17): the shard map, the step model with ranks, its scaling, and its refusals."""

from __future__ import annotations

import random

import pytest

from minioffload.machine import profiles
from minioffload.predict import memory, scaling, stepmodel
from minioffload.predict.shards import ring_bytes, shard_owners, shard_sizes
from minioffload.predict.stepmodel import StepConfig, Workload

SEVEN_B = Workload(7_000_000_000, 8 * 4096, "mixed_bf16", 291, False, 32, 300_000_000)


def test_shard_owners_is_greedy_balanced_and_deterministic():
    assert shard_owners([4, 4, 1], 2) == [0, 1, 0]  # ties go to the lowest rank
    assert shard_owners([5, 1, 1, 1, 1], 3) == [0, 1, 2, 1, 2]
    assert shard_owners([3, 3], 1) == [0, 0] and shard_owners([], 4) == []
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(0, 1000) for _ in range(rng.randint(1, 40))]
        ranks = rng.randint(1, 9)
        load = shard_sizes(sizes, ranks)
        assert sum(load) == sum(sizes) and max(load) - min(load) <= max(sizes)
        assert shard_owners(sizes, ranks) == shard_owners(list(sizes), ranks)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_ranks_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        shard_owners([1], bad)
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        StepConfig(ranks=bad)


def test_ring_bytes():
    assert ring_bytes("reduce", 8e9, 8) == pytest.approx(7e9)
    assert ring_bytes("all_gather", 8e9, 4) == pytest.approx(6e9)
    assert ring_bytes("all_reduce", 8e9, 2) == pytest.approx(8e9)
    assert ring_bytes("broadcast", 8e9, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        ring_bytes("gather", 1, 2)


@pytest.mark.parametrize("config", [{}, {"max_grad_norm": 1.0}, {"delay_updates_after": 0}, {"optimizer_on": "nvme"},
                                    {"optimizer_on": "device"}, {"params_on": "host"}, {"gpu_fraction": 0.25}])
def test_one_rank_is_todays_prediction(config):
    hw = profiles.preset("h100-sxm")
    base = stepmodel.predict(SEVEN_B, hw, StepConfig(**config))
    one = stepmodel.predict(SEVEN_B, hw, StepConfig(ranks=1, **config))
    assert one.step_s == base.step_s and one.busy == base.busy and one.bound == base.bound
    assert "net" not in one.busy and one.interconnect_bytes == 0 and one.ranks == 1


def test_one_rank_moves_the_gradients_down_and_the_weights_up():
    p = stepmodel.predict(SEVEN_B, profiles.preset("h100-sxm"), StepConfig())
    assert p.link_bytes == pytest.approx(2 * 2 * SEVEN_B.num_params, rel=1e-6)
    assert p.rank_link_bytes == (p.link_bytes,)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_each_rank_moves_and_updates_its_own_shard(ranks):
    hw, config = profiles.preset("8xh100-sxm"), StepConfig(max_grad_norm=1.0)
    one = stepmodel.predict(SEVEN_B, hw, config)
    many = stepmodel.predict(SEVEN_B, hw, config.replace(ranks=ranks))
    groups = SEVEN_B.subgroups(config.options.subgroup_numel)
    largest = max(params for params, _ in groups) * SEVEN_B.model_bytes * 2  # down and up
    assert len(many.rank_link_bytes) == ranks and sum(many.rank_link_bytes) == pytest.approx(one.link_bytes)
    for link in many.rank_link_bytes:
        assert abs(link - one.link_bytes / ranks) <= largest
    share = max(shard_sizes([params for params, _ in groups], ranks)) / SEVEN_B.num_params
    assert many.busy["cpu"] == pytest.approx(one.busy["cpu"] * share, rel=0.02)
    assert many.step_s < one.step_s  # the CPU-bound update is divided


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_interconnect_bytes_follow_the_ring_formula(ranks):
    hw, grads = profiles.preset("8xh100-sxm"), SEVEN_B.num_params * SEVEN_B.model_bytes
    sharded = stepmodel.predict(SEVEN_B, hw, StepConfig(ranks=ranks))  # a reduce and a broadcast of every subgroup
    assert sharded.interconnect_bytes == pytest.approx(2 * grads * (ranks - 1) / ranks, rel=1e-6)
    assert sharded.busy["net"] >= sharded.interconnect_bytes / hw.interconnect
    data_parallel = stepmodel.predict(SEVEN_B, hw, StepConfig(optimizer_on="device", ranks=ranks))  # an all-reduce
    assert data_parallel.interconnect_bytes == pytest.approx(2 * grads * (ranks - 1) / ranks, rel=1e-6)
    assert data_parallel.link_bytes == 0


def test_a_slow_interconnect_bounds_the_step():
    hw = profiles.preset("8xh100-sxm").replace(interconnect=1e9)
    p = stepmodel.predict(SEVEN_B, hw, StepConfig(ranks=8))
    assert p.bound == "net" and p.step_s >= p.interconnect_bytes / 1e9


def test_the_trace_shows_rank_0_and_the_shared_lanes():
    p = stepmodel.predict(SEVEN_B, profiles.preset("8xh100-sxm"), StepConfig(ranks=4, optimizer_on="nvme"))
    assert {s.lane for s in p.trace.spans} == {"compute", "net", "d2h", "h2d", "cpu", "nvme_read", "nvme_write"}
    assert stepmodel.resource_of("nvme_read:3", profiles.preset("h100-sxm")) == "nvme:3"
    assert stepmodel.resource_of("cpu:3", profiles.preset("laptop").replace(shared_host=True)) == "host"


def test_on_a_shared_host_the_ranks_share_the_cores():
    hw = profiles.preset("laptop").replace(shared_host=True)
    work = Workload(100_000_000, 2048, "fp32", 20)
    one, two = (stepmodel.predict(work, hw, StepConfig(ranks=r)) for r in (1, 2))
    assert two.busy["compute"] == pytest.approx(2 * one.busy["compute"], rel=0.01)


def test_streaming_and_the_hybrid_update_are_refused_with_ranks():
    with pytest.raises(ValueError, match="params_on='host' with ranks=2: the step model predicts a sharded state"):
        StepConfig(params_on="host", ranks=2)
    for option in ({"gpu_fraction": 0.5}, {"stride": 2}, {"delay_updates_after": 0}):
        with pytest.raises(ValueError, match="sharded, ranks=2 .train: shard., runs the synchronous CPU update"):
            StepConfig(ranks=2, **option)
    with pytest.raises(ValueError, match="sharded, ranks=2 .train: shard., runs the synchronous CPU update"):
        memory.engine_bytes([1 << 20] * 8, gpu_fraction=0.5, ranks=2)


def test_engine_bytes_per_rank_hold_the_largest_shard():
    numels = [1 << 20] * 7 + [1 << 19]
    one = memory.engine_bytes(numels, subgroup_numel=1 << 20)
    two = memory.engine_bytes(numels, subgroup_numel=1 << 20, ranks=2)
    assert two["device"] == one["device"]  # weights replicated
    assert two["host"] == one["host"] * 4 / 7.5  # rank 0 owns 4 of the 7.5M elements
    nvme_one = memory.engine_bytes(numels, subgroup_numel=1 << 20, optimizer_on="nvme")
    nvme_two = memory.engine_bytes(numels, subgroup_numel=1 << 20, optimizer_on="nvme", ranks=2)
    assert nvme_two["nvme"] == nvme_one["nvme"] * 4 / 7.5


def test_scaling_rows():
    rows = scaling.scaling(SEVEN_B, profiles.preset("8xh100-sxm"), (1, 2, 4, 8), StepConfig(max_grad_norm=1.0))
    assert [r["ranks"] for r in rows] == [1, 2, 4, 8]
    assert rows[0]["speedup"] == 1 and rows[0]["efficiency"] == 1 and rows[0]["interconnect_bytes"] == 0
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["ranks"] * SEVEN_B.tokens / r["step_s"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["ranks"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["ranks"])
    assert rows[-1]["efficiency"] > 1  # one rank was bound by the CPU update, which the shards divide
    assert rows[-1]["link_bytes"] < rows[0]["link_bytes"] / 7
    assert [r["ranks"] for r in scaling.scaling(SEVEN_B, profiles.preset("4xgh200"), (4,))] == [4]
    with pytest.raises(ValueError, match="at least one rank count"):
        scaling.scaling(SEVEN_B, profiles.preset("4xgh200"), ())


def test_capacity_and_the_published_figures():
    hw = profiles.preset("8xh100-sxm")
    assert scaling.capacity(hw, 8) == hw.device_memory / 2  # replicated weights cap it
    assert scaling.capacity(hw, 1) == pytest.approx(hw.host_memory / 18)
    assert {p["system"] for p in scaling.PUBLISHED} == {"ZeRO-Infinity", "SynergyScale"}
    assert all(p["gpus"] >= 1 and p["params"] > 1e11 for p in scaling.PUBLISHED)


def test_the_backward_waits_for_each_gradient_reduce():
    # The runtime reduces a subgroup's gradients from the gradient hook with a blocking call: the next subgroup's
    # backward starts after it. On a slow interconnect the step is then at least the compute plus every reduce.
    work = Workload(100_000_000, 2048, "fp32", 20)
    hw = profiles.preset("8xh100-sxm").replace(interconnect=1e9)
    p = stepmodel.predict(work, hw, StepConfig(ranks=2, subgroup_numel=10_000_000))
    reduces = [s for s in p.trace.spans if s.lane == "net" and "reduce" in s.name]
    assert len(reduces) == 10
    forward = next(s for s in p.trace.spans if s.lane == "compute" and s.name == "forward")
    backward_end = max(s.end for s in p.trace.spans if s.lane == "compute")
    assert backward_end - forward.start >= p.busy["compute"] + sum(s.end - s.start for s in reduces[:-1]) - 1e-9
