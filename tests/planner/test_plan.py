"""The planner: the exact solver against brute force, plans that fit by the calculator and on the sim, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from minioffload.cli.main import main
from minioffload.machine import profiles
from minioffload.planner import search as plan
from minioffload.planner.milp import BRUTE_FORCE_LIMIT, Option, Problem, brute_force, solve
from minioffload.planner.plan import ModelSpec, Plan
from minioffload.predict import memory
from minioffload.train.loop import train
from minioffload.units import GB, MiB


def random_problem(rng: random.Random) -> Problem:
    scale = rng.choice([1.0, 1e9])  # bytes near 1 and near a GB: the solver's tolerances must hold at both
    options = tuple(Option(f"p{i}", scale * rng.choice([0, rng.uniform(0, 10)]),
                           scale * rng.choice([0, rng.uniform(0, 5)]), rng.uniform(0, 2),
                           scale * rng.choice([0, 0, rng.uniform(0, 8)]))
                    for i in range(rng.randint(1, 5)))
    groups = rng.randint(1, 6)
    return Problem(rng.randint(1, 4), options, scale * rng.uniform(0, 30),
                   rng.choice([math.inf, scale * rng.uniform(0, 10)]), groups, rng.randint(0, groups),
                   scale * rng.uniform(0, 5), rng.uniform(0, 1), rng.uniform(0, 1), rng.random() < 0.5)


def test_the_milp_finds_what_brute_force_finds():
    rng = random.Random(0)
    infeasible = 0
    for _ in range(200):
        problem = random_problem(rng)
        exact, brute = solve(problem), brute_force(problem)
        assert (exact is None) == (brute is None), problem
        if exact is None:
            infeasible += 1
            continue
        assert exact.objective == pytest.approx(brute.objective, rel=1e-6, abs=1e-9), problem
        assert problem.fits(exact.counts, exact.resident)
        assert sum(exact.counts.values()) == problem.num_blocks
    assert 0 < infeasible < 200  # both kinds of case were tried


def test_the_milp_trades_recompute_for_memory_and_the_split_for_time():
    keep, recompute = Option("keep", 10.0, 0, 0.0), Option("recompute", 1.0, 0, 0.3)
    roomy = Problem(4, (keep, recompute), device_budget=40.0)
    assert solve(roomy).counts == {"keep": 4}
    tight = Problem(4, (keep, recompute), device_budget=22.0)  # 2 keep + 2 recompute = 22
    assert solve(tight).counts == {"keep": 2, "recompute": 2}
    assert solve(Problem(4, (keep, recompute), device_budget=3.0)) is None
    # the update: 4 subgroups, 1 s each on the CPU, 0.5 s on the device, each resident one costs 5 bytes
    split = Problem(1, (recompute,), 100.0, subgroups=4, max_resident=4, resident_bytes=5.0, cpu_s=1.0, device_s=0.5)
    assert solve(split).resident == 3  # max(1 x 1.0, 3 x 0.5) = 1.5 beats 2 (r=2) and 2 (r=4)
    shared = Problem(1, (recompute,), 100.0, subgroups=4, max_resident=4, resident_bytes=5.0, cpu_s=1.0,
                     device_s=0.5, shared=True)
    assert solve(shared).resident == 4  # on one set of cores the times add: the faster path takes everything


def test_a_policy_in_use_pays_its_copy_in_flight_once():
    keep, offload = Option("keep", 10.0, 0, 0.0), Option("offload", 0.0, 10.0, 0.1, in_flight_bytes=10.0)
    # 4 blocks in 30 bytes: keeping three and offloading one needs 30 + 10 in flight; two and two, 20 + 10
    best = solve(Problem(4, (keep, offload), device_budget=30.0))
    assert best.counts == {"keep": 2, "offload": 2}
    assert brute_force(Problem(4, (keep, offload), device_budget=30.0)).objective == pytest.approx(best.objective)
    assert solve(Problem(4, (keep, offload), device_budget=9.0)) is None  # offloading all still holds one in flight


def test_brute_force_refuses_what_it_cannot_enumerate():
    big = Problem(12, tuple(Option(f"p{i}", 1, 0, 1) for i in range(5)), 100.0)
    assert 5 ** 12 > BRUTE_FORCE_LIMIT
    with pytest.raises(ValueError, match="use solve"):
        brute_force(big)


SETUPS = [(ModelSpec.of_params(13e9), "h100-sxm", plan.Limits(batch=8, host_bytes=512 * GB)),
          (ModelSpec.of_params(70e9, 4096), "gh200", plan.Limits(batch=4, nvme_bytes=4000 * GB)),
          (ModelSpec.of_params(7e9), "rtx4090", plan.Limits(batch=4, nvme_bytes=2000 * GB)),
          (ModelSpec.of_preset("small"), "laptop", plan.Limits(batch=8, device_bytes=24 * MiB, precision="fp32"))]


@pytest.mark.parametrize("spec,hardware,limits", SETUPS, ids=[s[1] for s in SETUPS])
def test_every_plan_fits_by_the_calculator(spec, hardware, limits):
    hw = profiles.preset(hardware)
    plans = plan.search(spec, hw, limits)
    capacity = limits.capacity(hw)
    assert plans == sorted(plans, key=lambda p: -p.tokens_per_s)
    for p in plans:
        for tier in ("device", "host", "nvme"):
            assert capacity[tier] is None or p.memory[tier] <= capacity[tier], (p.describe(), tier)
        # the calculator's own count of the weights, gradients and state the plan keeps on the device, plus the
        # activations of its least-holding policy for every block: the plan claims no less
        if p.optimizer_on == "device":
            state = memory.footprint(p.precision, "adam", "device").bytes(spec.num_params, "device")
        elif p.params_on == "device":
            state = spec.num_params * (4 if p.precision == "fp32" else 2)
        else:
            state = memory.streamed_bytes(spec.num_params, spec.n_layer, spec.resident_params, p.params_on,
                                          p.prefetch, p.precision)["device"]
        assert p.memory["device"] >= state
        if set(p.activations) == {"keep"}:
            acts = memory.activation_bytes(spec.n_layer, spec.seq_len, p.micro_batch, spec.d_model, spec.n_head,
                                           "keep", 4 if p.precision == "fp32" else 2, spec.fused_attention)
            assert p.memory["device"] >= state + acts
        assert p.micro_batch * p.grad_accum == limits.batch
        assert p.step_s > 0 and p.bound


def test_the_planner_picks_selective_only_where_the_attention_keeps_scores():
    # with a fused kernel (the default, as models.GPT runs torch's SDPA) selective holds what keep holds: no plan uses
    # it; with attention written out it drops the scores and the planner uses it
    spec, hw = SETUPS[3][0], profiles.preset(SETUPS[3][1])
    fused = plan.search(spec, hw, SETUPS[3][2])
    unfused = plan.search(dataclasses.replace(spec, fused_attention=False), hw, SETUPS[3][2])
    assert spec.fused_attention and fused and not any("selective" in p.activations for p in fused)
    assert any("selective" in p.activations for p in unfused)



def test_the_plan_command_takes_the_attention_kernel(tmp_path, capsys):
    for attention in ("fused", "unfused"):
        out = tmp_path / f"{attention}.json"
        assert main(["plan", "--model", "tiny", "--hardware", "laptop", "--batch", "4", "--attention", attention,
                     "--out", str(out)]) == 0
        assert Plan.load(out).model.fused_attention == (attention == "fused")
    capsys.readouterr()


@pytest.mark.slow
def test_streaming_and_the_nvme_tier_appear_only_when_needed():
    hw = profiles.preset("h100-sxm")
    small = plan.search(ModelSpec.of_params(1.3e9), hw, plan.Limits(batch=8))[0]
    assert (small.optimizer_on, small.params_on) == ("device", "device")  # 1.3B fits an H100 whole
    big = plan.search(ModelSpec.of_params(30e9), hw, plan.Limits(batch=8))[0]
    assert big.optimizer_on == "nvme" or big.params_on != "device"
    assert plan.search(ModelSpec.of_params(30e9), hw, plan.Limits(batch=8, nvme_bytes=0, host_bytes=1000 * GB))
    assert all(p.optimizer_on != "nvme" and p.params_on != "nvme"
               for p in plan.search(ModelSpec.of_params(13e9), hw, plan.Limits(batch=8, nvme_bytes=0)))


def test_unified_memory_moves_the_optimum():
    spec, limits = ModelSpec.of_params(7e9), plan.Limits(batch=8)
    h200 = plan.search(spec, profiles.preset("h200"), limits)[0]
    gh200 = plan.search(spec, profiles.preset("gh200"), limits)[0]
    # on an H200 the 7B state fits the device; on GH200's 96 GB it does not, but its C2C link and 72 cores make
    # the host's optimizer nearly as fast as the H200's own
    assert h200.optimizer_on == "device" and gh200.optimizer_on == "host"
    h100 = plan.search(spec, profiles.preset("h100-sxm"), limits)[0]
    assert h100.optimizer_on == "host" and h100.step_s > 3 * gh200.step_s


def test_a_model_that_fits_nowhere_is_named_with_the_bytes_missing():
    with pytest.raises(plan.NoPlanError, match=r"TiB more host memory") as info:  # no drive: all on the host
        plan.search(ModelSpec.of_params(70e9), profiles.preset("rtx4090"), plan.Limits(batch=8, nvme_bytes=0))
    assert info.value.short["host"] > 100 * GB
    with pytest.raises(plan.NoPlanError, match="more device memory"):
        plan.search(ModelSpec.of_preset("small"), profiles.preset("laptop"),
                    plan.Limits(batch=8, device_bytes=1 * MiB, precision="fp32"))


@pytest.mark.parametrize("kwargs,match", [({"batch": 0}, "batch must be a positive int"),
                                          ({"host_bytes": -1}, "host_bytes must be"),
                                          ({"precision": "fp8"}, "precision must be one of"),
                                          ({"batch": 8, "micro_batches": (3,)}, "must divide the batch"),
                                          ({"mfu": 0}, "mfu must be in")])
def test_impossible_limits_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan.Limits(**kwargs)


def test_a_plan_survives_json_and_refuses_what_is_not_a_plan(tmp_path):
    p = plan.search(ModelSpec.of_preset("tiny"), profiles.preset("laptop"), plan.Limits(batch=4, precision="fp32"))[0]
    assert Plan.load(p.save(tmp_path / "p.json")) == p
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a minioffload plan"):
        Plan.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no plan at"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="one policy of"):
        Plan(ModelSpec.of_preset("tiny"), "laptop", "fp32", 1, 1, "host", "device", ("keep",))  # 2 blocks


def test_fit_compute_recovers_a_line():
    spec, hw = ModelSpec.of_preset("small"), profiles.preset("laptop")
    per_sequence = 6 * spec.num_params * spec.seq_len / (0.3 * hw.peak_flops("fp32"))
    measured = {m: spec.n_layer * 2e-3 + m * per_sequence for m in (1, 2, 4, 8)}
    flops, overhead = plan.fit_compute(measured, spec)
    assert flops / hw.peak_flops("fp32") == pytest.approx(0.3) and overhead == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="two micro-batch sizes"):
        plan.fit_compute({4: 0.1}, spec)
    # one size measured during another process's burst (seen in CI) moves the line by nothing
    stalled = {**measured, 2: 6 * measured[2]}
    assert plan.fit_compute(stalled, spec) == pytest.approx((flops, overhead))
    with pytest.raises(ValueError, match="did not grow"):
        plan.fit_compute({1: 0.3, 2: 0.2, 4: 0.1}, spec)


def test_plans_run_on_the_sim_within_the_device_memory_they_predict(tmp_path):
    spec = ModelSpec.of_preset("tiny")
    hw = profiles.preset("laptop")
    plans = plan.best_per_family(plan.search(spec, hw, plan.Limits(batch=4, device_bytes=2 * MiB, precision="fp32")))
    kinds = {(p.optimizer_on, p.params_on) for p in plans}
    # ("host", "nvme"): the weights in a directory of their own (weights_dir), the optimizer's state in host memory
    assert {("host", "host"), ("host", "nvme"), ("nvme", "nvme"), ("nvme", "device")} <= kinds
    for i, p in enumerate(plans):
        config = plan.train_config(p, device="sim", steps=2, progress=False, device_memory=int(p.capacity["device"]),
                                   out_dir=str(tmp_path / f"run{i}"), nvme_dir=str(tmp_path / f"nvme{i}"))
        summary = train(config).summary
        assert summary["device_peak_bytes"] <= p.memory["device"], p.describe()
        assert math.isfinite(summary["final_train_loss"])


def test_a_plan_stays_within_its_device_memory_when_the_copies_to_the_host_lag(tmp_path, monkeypatch):
    """The device bytes a plan promises hold however far the copies to the host fall behind the host (a busy host
    slows the sim's stream threads; a slow bus, a GPU's): a plan with every block's activations offloaded and the
    optimizer on the host, on a device whose D2H link is 20x slower than the sim's and whose copies start late.
    Gradients waiting for their copies are bounded by the engine and counted by the planner; unbounded, they pile up
    and this plan runs out of memory in backward."""
    from minioffload.devices.common import Link
    from minioffload.train import loop

    made = loop.make_device
    monkeypatch.setattr(loop, "make_device", lambda kind, **options: made(
        kind, d2h=Link(bandwidth=100e6), jitter=5e-4, seed=1, **options))
    spec = ModelSpec.of_preset("medium", 64)
    fast_link = profiles.preset("laptop").replace(link_h2d=1e12, link_d2h=1e12)  # offloading costs nothing: chosen
    plans = plan.search(spec, fast_link, plan.Limits(batch=8, device_bytes=64 * MiB, precision="fp32"))
    p = next(p for p in plans if set(p.activations) == {"offload"} and p.params_on == "device"
             and p.optimizer_on == "host" and p.micro_batch == 8)
    config = plan.train_config(p, device="sim", steps=2, eval_every=20, progress=False,
                               device_memory=int(p.capacity["device"]), out_dir=str(tmp_path / "run"))
    assert train(config).summary["device_peak_bytes"] <= p.memory["device"], p.describe()


def test_train_config_refuses_a_plan_it_cannot_run():
    big = plan.search(ModelSpec.of_params(13e9), profiles.preset("h100-sxm"), plan.Limits(batch=8))[0]
    with pytest.raises(ValueError, match="course's GPT presets"):
        plan.train_config(big)
    nvme = next(p for p in plan.search(ModelSpec.of_preset("tiny"), profiles.preset("laptop"),
                                       plan.Limits(batch=4, precision="fp32")) if p.optimizer_on == "nvme")
    with pytest.raises(ValueError, match="give nvme_dir"):
        plan.train_config(nvme)


def test_the_plan_command_prints_ranks_and_writes_a_plan_train_runs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--hardware", "laptop", "--batch", "4", "--out", str(out),
                 "--export", str(tmp_path / "elsewhere"), "--lr", "3e-4"]) == 0
    text = capsys.readouterr().out
    assert "chosen:" in text and "the others lose:" in text and "x the step" in text
    ds = json.loads((tmp_path / "elsewhere" / "deepspeed.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] == 4
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["gradient_clipping"] == 1.0
    compile((tmp_path / "elsewhere" / "fsdp2_plan.py").read_text(), "fsdp2_plan.py", "exec")
    chosen = Plan.load(out)
    assert chosen.model.preset == "tiny" and chosen.step_s > 0
    assert main(["train", "--plan", str(out), "--device", "sim", "--steps", "2", "--no-progress",
                 "--out-dir", str(tmp_path / "run"), "--nvme-dir", str(tmp_path / "nvme")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["batch_size"] == chosen.micro_batch
    assert summary["config"]["params_on"] == chosen.params_on


@pytest.mark.parametrize("argv,match", [
    (["plan", "--hardware", "h100-node"], "unknown hardware preset 'h100-node'"),
    (["plan", "--batch", "0"], "--batch must be a positive int"),
    (["plan", "--host-gb", "-5"], "--host-gb must be a number of GB >= 0"),
    (["plan", "--params", "70B", "--hardware", "rtx4090", "--nvme-gb", "0"], "more host memory"),
])
def test_the_plan_command_names_bad_input(argv, match, capsys):
    code = None
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code not in (0, None)
    assert match in capsys.readouterr().err


def test_train_refuses_flags_the_plan_sets_and_plans_it_cannot_run(tmp_path, capsys):
    small = tmp_path / "small.json"
    main(["plan", "--model", "tiny", "--hardware", "laptop", "--batch", "4", "--nvme-gb", "0", "--out", str(small)])
    with pytest.raises(SystemExit):
        main(["train", "--plan", str(small), "--batch-size", "16"])
    assert "--batch-size: set by --plan" in capsys.readouterr().err
    big = tmp_path / "big.json"
    main(["plan", "--params", "13B", "--out", str(big)])
    with pytest.raises(SystemExit):
        main(["train", "--plan", str(big), "--device", "sim", "--out-dir", str(tmp_path / "r")])
    assert "course's GPT presets" in capsys.readouterr().err


def test_two_ranks_hold_an_optimizer_state_one_rank_cannot():
    spec, hw = ModelSpec.of_params(7e9), profiles.preset("8xh100-sxm")
    one = plan.Limits(batch=2, host_bytes=80 * GB, nvme_bytes=0)
    with pytest.raises(plan.NoPlanError):
        plan.search(spec, hw, one)
    plans = plan.search(spec, hw, plan.Limits(batch=2, host_bytes=80 * GB, nvme_bytes=0, ranks=2))
    assert plans and all(p.ranks == 2 and p.params_on == "device" and p.optimizer_on != "device" and not p.delay
                         and p.gpu_fraction is None for p in plans)
    assert all(p.memory["host"] <= 80 * GB for p in plans)
    best = plans[0]
    assert "2 ranks" in best.describe() and best.tokens_per_step == 2 * best.micro_batch * best.grad_accum * 2048
    numels = plan.tensor_numels(spec)
    assert plan._state_bytes(spec, plan._key(best), "mixed_bf16", 2)["host"] == memory.engine_bytes(
        numels, "mixed_bf16", best.placement, best.options)["host"]
    again = plan.prediction(best, hw)
    assert again.ranks == 2 and again.interconnect_bytes > 0
    assert Plan.from_dict(json.loads(json.dumps(best.to_dict()))) == best


def test_ranks_refusals_in_the_planner():
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        plan.Limits(ranks=0)
    spec = ModelSpec.of_preset("tiny")
    p = Plan(spec, "h100-sxm", "fp32", 1, 1, "host", "host", ("keep",) * spec.n_layer, prefetch=1)
    for changes, says in (({}, "the step model predicts a sharded state with every weight on each device"),
                          ({"params_on": "device", "delay": True}, "runs the synchronous CPU update"),
                          ({"optimizer_on": "device", "params_on": "device"}, "needs the offloaded optimizer")):
        with pytest.raises(ValueError, match=f"^Plan: .*ranks=2.*{says}"):
            dataclasses.replace(p, ranks=2, **changes)
    config = plan.train_config(dataclasses.replace(p, params_on="device", prefetch=0, ranks=2))
    assert config.shard and config.offload  # run under torchrun --nproc-per-node 2
    with pytest.raises(plan.NoPlanError, match="with ranks > 1 only the sharded engine is planned"):
        plan.search(ModelSpec.of_params(70e9), profiles.preset("h100-sxm"),
                    plan.Limits(batch=1, host_bytes=10 * GB, nvme_bytes=0, ranks=2))


def test_plan_cli_ranks(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--params", "7B", "--hardware", "8xh100-sxm", "--ranks", "4", "--batch", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "on each of 4 ranks" in printed and "memory per rank" in printed
    assert Plan.load(out).ranks == 4
    with pytest.raises(SystemExit):
        main(["plan", "--params", "7B", "--ranks", "0"])
    assert "--ranks must be an int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("params_on", ["host", "nvme"])
def test_each_extra_micro_batch_pays_its_streamed_fetches_fixed_costs(params_on):
    # the other micro-batches fetch the blocks again: each fetch costs the host fetch_overhead, and from NVMe each read
    # nvme_read_overhead (on a GPU host, where the drive's reads are the longest move here)
    spec = ModelSpec.of_params(1.3e9)
    base = profiles.preset("rtx4090").replace(nvme_read=profiles.preset("rtx4090").link_h2d / 20)
    limits = plan.Limits(batch=8, micro_batches=(1,), precision="mixed_bf16")
    c = plan._Config("host", params_on, 1, False, False, 1 << 24, 1)
    fetches = plan.streamed_fetches(spec.n_layer, 1)
    assert fetches == 2 * spec.n_layer - 1  # the last block stays from its forward to its backward

    def more(**costs) -> float:
        return plan._accumulation_s(spec, base.replace(**costs), c, limits)

    if params_on == "host":  # the fetch's host time lands on the compute: on a shared host, compute + sum
        shared = dict(shared_host=True)
        assert more(fetch_overhead=0.011, **shared) - more(fetch_overhead=0.001, **shared) == pytest.approx(
            fetches * 0.01)
    else:
        assert more(nvme_read_overhead=0.011) - more(nvme_read_overhead=0.001) == pytest.approx(fetches * 0.01)


def test_step_seconds_repredicts_a_plan_with_its_choices_kept():
    spec, hw = ModelSpec.of_preset("small"), profiles.preset("laptop").replace(shared_host=True)
    limits = plan.Limits(batch=8, device_bytes=24 * MiB, precision="fp32", mfu=0.5, block_overhead_s=1e-3)
    plans = plan.search(spec, hw, limits)
    picked = plan.best_per_family(plans) + [p for p in plans if p.grad_accum > 1][:3]
    assert any(p.params_on != "device" for p in picked) and any(p.grad_accum > 1 for p in picked)
    for p in picked:  # with what it was planned with: its own step
        assert plan.step_seconds(p, hw, limits) == pytest.approx(p.step_s, rel=1e-9), p.describe()
    # a faster compute shortens the same plan's step (its policies kept, whatever a new search would choose)
    faster = hw.replace(peak_flops_fp32=2 * hw.peak_flops_fp32)
    assert all(plan.step_seconds(p, faster, limits) < p.step_s for p in picked)


def test_175b_on_one_rtx4090_fits_only_with_its_gradients_on_nvme():
    """Fuyou's setup: 175B on one RTX 4090 with 256 GB of host memory and 8 TB of NVMe. The gradients alone would
    take 1 TB of host memory (6 B/param); on the drive with the state, a few pinned sets of them do."""
    limits = plan.Limits(batch=8, host_bytes=256 * GB, nvme_bytes=8000 * GB)
    plans = plan.search(ModelSpec.of_params(175e9), profiles.preset("rtx4090"), limits)
    assert plans and all(p.grads_on == "nvme" and p.optimizer_on == p.params_on == "nvme" for p in plans)
    best = plans[0]
    assert best.memory["host"] <= 256 * GB and best.memory["nvme"] > 16 * 175e9  # state and gradients on the drive
    assert best.step_config().placement.grads_on == "nvme"  # predicted as planned
    with pytest.raises(plan.NoPlanError, match="unless they are on NVMe with it"):  # and without the drive, nothing
        plan.search(ModelSpec.of_params(175e9), profiles.preset("rtx4090"), dataclasses.replace(limits, nvme_bytes=0))


def test_70b_on_an_h100_fits_a_512_gb_host_either_way():
    limits = plan.Limits(batch=8, host_bytes=512 * GB)
    plans = plan.search(ModelSpec.of_params(70e9), profiles.preset("h100-sxm"), limits)
    assert {p.grads_on for p in plans} == {"host", "nvme"} and all(p.memory["host"] <= 512 * GB for p in plans)
    on_drive = min((p for p in plans if p.grads_on == "nvme"), key=lambda p: p.memory["host"])
    on_host = min((p for p in plans if p.grads_on == "host"), key=lambda p: p.memory["host"])
    assert on_host.memory["host"] - on_drive.memory["host"] > 5 * 70e9  # the gradients' 6 B/param left the host
