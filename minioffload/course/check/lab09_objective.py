"""Grader for Lab 9's Task 9.2: the planner's objective, a plan's tokens per second. Task 9.1: lab09.py; Task 9.3:
lab09_search.py.

The learner's tokens/s is checked against plan.search itself: three searches (a course GPT in fp32 on a laptop preset,
the same on that preset as a shared host like the simulated device, with a lower mfu and a larger per-block overhead,
and a GPT-3 1.3B in bf16 on an RTX 4090 with NVMe), and for each the first plan of every family (where the optimizer
and the weights live, the delayed update, the hybrid split) and every number of micro-batches. The learner gets each
plan with its predictions blanked (step_s 0, no busy lanes, no bound) and must give its tokens/s to 1e-6. A mismatch is
named when it equals what a plausible mistake gives, priced by the search's own parts (plan.prediction, plan._compute_s,
plan._accumulation_s). Verdicts carry counts, never timings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from ...machine import profiles
from ...planner import search as plan
from ...planner.plan import ModelSpec, Plan
from ...predict import stepmodel
from ...predict.activation_cost import BlockShape, policy_costs
from ...units import GB, MiB
from .grading import grader

RTOL = 1e-6
OVERHEAD = ("n_layer x limits.block_overhead_s for every micro-batch, the first one's included (stepmodel.predict "
            "counts FLOPs only)")


def _setups() -> tuple:
    course = ModelSpec(6, 128, 4, 74, 128)
    laptop = profiles.preset("laptop")
    shared = laptop.replace(name="laptop-shared", shared_host=True)  # the device computes on the CPU's cores
    small = plan.Limits(batch=8, device_bytes=24 * MiB, precision="fp32", micro_batches=(2, 8))
    return (
        (course, laptop, small),
        (course, shared, dataclasses.replace(small, mfu=0.3, block_overhead_s=2e-4)),
        (ModelSpec.of_params(1.3e9), profiles.preset("rtx4090"),
         plan.Limits(batch=4, host_bytes=24 * GB, nvme_bytes=2000 * GB, micro_batches=(1, 2))),
    )


def _family(p: Plan) -> tuple:
    return p.optimizer_on, p.params_on, p.delay, p.gpu_fraction is not None, p.grad_accum


@functools.lru_cache(maxsize=1)
def plans() -> tuple:
    """(plan, hw, limits): the first plan of each family and number of micro-batches, search by search."""
    out = []
    for model, hw, limits in _setups():
        seen = set()
        for p in plan.search(model, hw, limits):
            if _family(p) not in seen:
                seen.add(_family(p))
                out.append((p, hw, limits))
    return tuple(out)


def blank(p: Plan) -> Plan:
    """The plan as the learner gets it: its configuration, none of its predictions."""
    return dataclasses.replace(p, step_s=0.0, busy={}, bound="")


def _config(p: Plan):
    return plan._Config(p.optimizer_on, p.params_on, p.prefetch, p.delay, p.gpu_fraction is not None,
                        p.subgroup_numel, p.micro_batch)


def _mistakes(p: Plan, hw: profiles.Hardware, limits: plan.Limits) -> list[tuple[str, float]]:
    """(the mistake, the step seconds it gives), most specific first."""
    model, accum, c = p.model, p.grad_accum, _config(p)
    mb = 4 if p.precision == "fp32" else 2
    one = plan.prediction(p, hw, limits).step_s
    overhead = model.n_layer * limits.block_overhead_s
    block = BlockShape(model.seq_len, p.micro_batch, model.d_model, model.n_head, mb, model.fused_attention)
    costs = policy_costs(block, hw, limits.mfu)
    per_pass = sum(costs[a].extra_s for a in p.activations)
    more = plan._accumulation_s(model, hw, c, limits)
    step = p.step_s
    out = [("the other micro-batches left out: with grad_accum > 1 each one more runs its forward and backward "
            "(and moves its gradients) before the update", step - (accum - 1) * more),
           ("the whole step repeated per micro-batch: the update runs once a step; each extra micro-batch adds its "
            "forward and backward, or its moves, whichever is longer", accum * (one + overhead + per_pass)),
           ("the activation policies' time counted once: every micro-batch recomputes or offloads again "
            "(PolicyCost.extra_s per block, times grad_accum)", step - per_pass * (accum - 1)),
           ("the activation policies' time left out: each block's PolicyCost.extra_s, for every micro-batch",
            step - per_pass * accum),
           (f"the per-block overhead left out: {OVERHEAD}", step - overhead * accum),
           (f"the first micro-batch's per-block overhead left out: {OVERHEAD}", step - overhead)]
    if p.optimizer_on == "device":
        return out
    compute = plan._compute_s(model, hw, c, limits)
    hooks = model.num_tensors * (hw.grad_hook_overhead + hw.copy_overhead)
    summed = model.num_params * (stepmodel.ACCUMULATE_BYTES + mb) / hw.host_bandwidth
    moves = [model.num_params * mb / hw.link_d2h, summed]
    fetches, fetch_host, bare_fetches = [], 0.0, []
    if p.params_on != "device":
        count = plan.streamed_fetches(model.n_layer, p.prefetch)
        block = model.block_params * mb
        fetch_host = count * hw.fetch_overhead
        fetches = [count * (model.block_tensors * hw.link_latency + block / hw.link_h2d)]
        bare_fetches = [count * block / hw.link_h2d]
        if p.params_on == "nvme":
            fetches.append(count * (hw.nvme_read_overhead + block / hw.nvme_read))
            bare_fetches.append(count * block / hw.nvme_read)

    def with_more(seconds: float) -> float:
        return step - (accum - 1) * (more - seconds)

    if hw.shared_host:
        out.append(("the longest of compute and moves on a shared host: there (the simulated device) the device "
                    "computes on the CPU's cores, so the gradients' host sum runs after the compute, not beside it: "
                    "compute + sum", with_more(max(compute + fetch_host + hooks, *moves, *fetches))))
        out.append(("the hooks' copies left out: each extra micro-batch issues every gradient's copy again, "
                    "num_tensors x (grad_hook_overhead + copy_overhead) of host time",
                    with_more(compute + fetch_host + summed)))
    else:
        out.append(("compute and moves added up on a GPU: its copies and the host's sum run beside its compute, so "
                    "an extra micro-batch takes the longest of them",
                    with_more(compute + fetch_host + hooks + summed)))
        out.append(("the hooks' copies left out: each extra micro-batch issues every gradient's copy again, "
                    "num_tensors x (grad_hook_overhead + copy_overhead) of host time",
                    with_more(max(compute + fetch_host, *moves, *fetches))))
        if fetches:
            what = ("the streamed blocks' fetches or their fixed costs left out: each extra micro-batch brings the "
                    "blocks up again (forward and backward), over the link and, from NVMe, off the drive; each fetch "
                    "costs the host fetch_overhead, each of its copies link_latency, each NVMe read "
                    "nvme_read_overhead, besides its bytes")
            out.append((what, with_more(max(compute + hooks, *moves))))
            out.append((what, with_more(max(compute + hooks, *moves, *bare_fetches))))
    return out


def _lazy_mistakes(p: Plan, hw: profiles.Hardware, limits: plan.Limits) -> list[tuple[str, float]]:
    """Mistakes in the prediction itself: each one a step model run more."""
    def predicted(tokens: int, clip: bool) -> float:
        model = p.model
        work = stepmodel.Workload(model.num_params, tokens, p.precision, model.num_tensors, False, model.n_layer,
                                  model.resident_params)
        config = p.step_config(limits.mfu).replace(max_grad_norm=p.options.max_grad_norm if clip else None)
        return stepmodel.predict(work, hw, config).step_s

    one = plan.prediction(p, hw, limits).step_s
    out = []
    if p.optimizer_on != "device":
        out.append(("no clipping in the prediction: the planner's plans clip gradients (Plan.options sets "
                    "max_grad_norm=1.0, for the step model and train alike), one more pass over the host's gradients",
                    p.step_s - one + predicted(p.micro_batch * p.model.seq_len, False)))
    if p.grad_accum > 1:
        whole = predicted(p.tokens_per_step, True)
        what = ("the whole batch predicted as one micro-batch: stepmodel.predict is for one micro-batch of "
                "micro_batch x seq_len tokens; the others come after it, (grad_accum - 1) x one more micro-batch")
        policies = p.step_s - one - p.model.n_layer * limits.block_overhead_s \
            - (p.grad_accum - 1) * plan._accumulation_s(p.model, hw, _config(p), limits)
        out += [(what, p.step_s - one + whole), (what, whole + p.model.n_layer * limits.block_overhead_s + policies)]
    return out


def _hint(p: Plan, hw: profiles.Hardware, limits: plan.Limits, got: float) -> str:
    want = p.tokens_per_s
    if math.isclose(got, p.step_s, rel_tol=RTOL):
        return "that is the step's seconds: return tokens per second, the step's tokens over its seconds"
    if math.isclose(got, want / p.grad_accum, rel_tol=RTOL):
        return ("the tokens of one micro-batch over the step's seconds: a step trains micro_batch x grad_accum x "
                "seq_len tokens")
    for what, seconds in [*_mistakes(p, hw, limits), *_lazy_mistakes(p, hw, limits)]:
        if seconds > 0 and math.isclose(got, p.tokens_per_step / seconds, rel_tol=RTOL) \
                and not math.isclose(seconds, p.step_s, rel_tol=RTOL):
            return what
    return ("the step is stepmodel.predict's step for one micro-batch, plus n_layer x block_overhead_s, plus the "
            "policies' extra_s for every block and micro-batch, plus (grad_accum - 1) x one more micro-batch")


@grader("9.2", rebuilds=(
    "minioffload.planner.search.prediction",
    "minioffload.planner.search.step_seconds",
    "minioffload.planner.search._accumulation_s",
))
def tokens_per_second(fn: Callable) -> str:
    """fn(plan, hw, limits) -> the plan's tokens per second, as plan.search predicts it."""
    cases = plans()
    for p, hw, limits in cases:
        got = fn(blank(p), hw, limits)
        call = f"tokens_per_s(<{p.describe()}>, {hw.name}, <limits: mfu {limits.mfu}, {limits.precision}>)"
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got) or got <= 0:
            raise AssertionError(f"{call} returned {got!r:.60}; expected a positive number of tokens per second")
        if not math.isclose(got, p.tokens_per_s, rel_tol=RTOL):
            raise AssertionError(f"{call} returned {got:,.6g} tokens/s; the planner predicts {p.tokens_per_s:,.6g}: "
                                 f"{_hint(p, hw, limits, got)}")
    accumulated = sum(p.grad_accum > 1 for p, _, _ in cases)
    shared = sum(hw.shared_host for _, hw, _ in cases)
    return (f"{len(cases)} plans from {len(_setups())} searches (every family of where the optimizer and the weights "
            f"live, {accumulated} with gradient accumulation, {shared} on a shared host): your tokens/s are the "
            "planner's, to 1e-6")
