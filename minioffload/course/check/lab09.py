"""Graders for Lab 9, "Planning the run": a configuration that fits every tier and is close to the best (9.1).

Task 9.2 (a lower bound on a plan's step) is graded in lab09_objective.py, Task 9.3 (the exact choice of activation
policies and hybrid split) in lab09_search.py.

Task 9.1 asks for a design, not a number: `configure(model, hw, limits)` returns one configuration (where the
optimizer and the weights live, the micro-batch, one activation policy for every block, the prefetch depth, the
subgroup size). Many answers are right. What must hold, on three models and machines: the configuration fits every
tier by the planner's count (plan._state_bytes and plan._problem, asked through `parts`), and its step, as the planner
predicts it (plan.step_seconds), reaches 90% of the tokens per second of the fastest configuration of that kind,
found here by trying them all. A configuration that does not fit is answered with the planner's count of it, part by
part, so the learner sees what they left out. Verdicts carry the model's figures (arithmetic, the same every run),
never a measured time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ...machine import profiles
from ...planner import search as plan
from ...planner.plan import HOMES, ModelSpec, Plan
from ...predict.activation_cost import POLICIES, BlockShape, policy_costs
from ...units import GB, MiB, format_bytes
from .grading import grader

TIERS = ("device", "host", "nvme")
KEYS = ("optimizer_on", "params_on", "micro_batch", "policy", "prefetch", "subgroup_numel")
GOAL = 0.9  # of the fastest one-policy configuration's tokens per second
SUBGROUPS = (1 << 16, 1 << 26)  # the subgroup sizes a configuration may take, inclusive


def _setups() -> tuple:
    """(model, machine, limits): a 7B model on a consumer GPU with NVMe, a 13B model on an H100 and its host, and the
    course GPT in fp32 squeezed into 12 MiB of device memory with no NVMe."""
    return (
        (ModelSpec.of_params(7e9), profiles.preset("rtx4090"), plan.Limits(batch=8, nvme_bytes=2000 * GB)),
        (ModelSpec.of_params(13e9), profiles.preset("h100-sxm"), plan.Limits(batch=8)),
        (ModelSpec(6, 128, 4, 74, 128), profiles.preset("laptop"),
         plan.Limits(batch=8, device_bytes=12 * MiB, precision="fp32", nvme_bytes=0)),
    )


@dataclasses.dataclass(frozen=True)
class Case:
    model: ModelSpec
    hw: profiles.Hardware
    limits: plan.Limits
    optimizer_on: str
    params_on: str
    micro_batch: int
    policy: str
    prefetch: int
    subgroup_numel: int

    def kwargs(self) -> dict:
        return {"optimizer_on": self.optimizer_on, "params_on": self.params_on, "micro_batch": self.micro_batch,
                "policy": self.policy, "prefetch": self.prefetch, "subgroup_numel": self.subgroup_numel}

    def call(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs().items())
        return f"fits(<{self.model}>, {self.hw.name}, <limits: {self.limits.precision}>, {args})"

    @property
    def config(self):
        return plan._Config(self.optimizer_on, self.params_on, self.prefetch, False, False, self.subgroup_numel,
                            self.micro_batch)


@dataclasses.dataclass(frozen=True)
class Parts:
    """The planner's count of one case, in pieces: state per tier, a block's activations under the policy (device,
    host), an offloaded set in flight, the block in backward, the gradients on their way to the host, the head's
    inputs, the logits."""

    state: dict
    held: float
    offloaded: float
    in_flight: float
    full: float
    grads: float
    head: float
    logits: float
    n_layer: int

    def need(self) -> dict:
        return {"device": self.state["device"] + self.n_layer * self.held + self.in_flight + self.full + self.grads
                + self.head + self.logits,
                "host": self.state["host"] + self.n_layer * self.offloaded, "nvme": self.state["nvme"]}


def parts(case: Case, precision: str | None = None) -> Parts:
    """planner/search.py's count of `case` (its activations at `precision`'s value size when given)."""
    limits = dataclasses.replace(case.limits, precision=precision or case.limits.precision)
    capacity = limits.capacity(case.hw)
    state = plan._state_bytes(case.model, case.config, case.limits.precision)
    problem, outside = plan._problem(case.model, case.hw, case.config, limits, capacity, state, 1)
    option = next(o for o in problem.options if o.name == case.policy)
    logits = plan.LOGIT_BYTES * case.micro_batch * case.model.seq_len * case.model.vocab
    value_bytes = 4 if limits.precision == "fp32" else 2
    head = plan.HEAD_VALUES * case.micro_batch * case.model.seq_len * case.model.d_model * value_bytes
    in_flight = getattr(option, "in_flight_bytes", 0.0)
    grads = 0
    if case.optimizer_on != "device" and case.params_on == "device":
        sizes = plan.pack_sizes(plan.tensor_numels(case.model), case.subgroup_numel)
        grads = (max(sizes) + max(plan.tensor_numels(case.model))) * value_bytes
    return Parts(dict(state), option.device_bytes, option.host_bytes, in_flight, outside - logits - head - grads,
                 grads, head, logits, case.model.n_layer)


def shortfall(need: dict, capacity: dict) -> dict:
    return {t: max(0.0, need[t] - capacity[t]) if capacity[t] is not None else 0.0 for t in TIERS}


def _plan(case: Case) -> Plan:
    return Plan(case.model, case.hw.name, case.limits.precision, case.micro_batch,
                case.limits.batch // case.micro_batch, case.optimizer_on, case.params_on,
                (case.policy,) * case.model.n_layer, case.prefetch, case.subgroup_numel)


def tokens_per_s(case: Case) -> float:
    """The planner's tokens per second for `case`, every block under its one policy."""
    p = _plan(case)
    return p.tokens_per_step / plan.step_seconds(p, case.hw, case.limits)


@functools.cache
def fastest(setup: int) -> tuple[float, Case]:
    """The fastest one-policy configuration of setup `setup` that fits: every configuration the planner enumerates
    (neither the delayed update nor the hybrid split), every policy."""
    model, hw, limits = _setups()[setup]
    capacity = limits.capacity(hw)
    best = (0.0, None)
    for c in plan._configs(model, limits, capacity):
        if c.delay or c.hybrid:
            continue
        fitting = [case for policy in POLICIES
                   if not any(shortfall(parts(case := Case(model, hw, limits, c.optimizer_on, c.params_on,
                                                          c.micro_batch, policy, c.prefetch, c.subgroup_numel)
                                              ).need(), capacity).values())]
        if not fitting:
            continue
        # the step model's prediction does not depend on the policy: predict once, then add each policy's time
        first = fitting[0]
        step = plan.step_seconds(_plan(first), hw, limits)
        block = BlockShape(model.seq_len, c.micro_batch, model.d_model, model.n_head,
                           4 if limits.precision == "fp32" else 2, model.fused_attention)
        extra = {name: cost.extra_s for name, cost in policy_costs(block, hw, limits.mfu).items()}
        accum = limits.batch // c.micro_batch
        for case in fitting:
            seconds = step + accum * model.n_layer * (extra[case.policy] - extra[first.policy])
            speed = limits.batch * model.seq_len / seconds
            if speed > best[0]:
                best = (speed, case)
    return best


def _refused(config, limits: plan.Limits) -> str:
    """Why `config` is not a configuration the runtime has, or ""."""
    if not isinstance(config, dict) or set(config) != set(KEYS):
        got = sorted(config) if isinstance(config, dict) else type(config).__name__
        return f"expected a dict with the keys {', '.join(KEYS)}, got {got}"
    opt, params, micro, prefetch, numel = (config[k] for k in ("optimizer_on", "params_on", "micro_batch",
                                                                 "prefetch", "subgroup_numel"))
    if opt not in HOMES or params not in HOMES:
        return f"optimizer_on and params_on are each one of {', '.join(HOMES)}; got {opt!r} and {params!r}"
    if opt == "device" and params != "device":
        return ("weights streamed with the optimizer on the device: the runtime streams weights only with "
                "OffloadAdam (optimizer_on 'host' or 'nvme')")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1 or limits.batch % micro:
        return f"micro_batch must be a positive int that divides the batch ({limits.batch}), got {micro!r}"
    if config["policy"] not in POLICIES:
        return f"policy must be one of {', '.join(POLICIES)}, got {config['policy']!r}"
    if prefetch not in plan.PREFETCH_DEPTHS or (params == "device" and prefetch):
        return (f"prefetch is one of {plan.PREFETCH_DEPTHS} with streamed weights, and 0 when they stay on the device; "
                f"got {prefetch!r}")
    if isinstance(numel, bool) or not isinstance(numel, int) or not SUBGROUPS[0] <= numel <= SUBGROUPS[1]:
        return f"subgroup_numel must be an int from 2**16 to 2**26 (elements), got {numel!r}"
    return ""


def _breakdown(case: Case, p: Parts, tier: str) -> str:
    if tier == "device":
        flight = f" + one set in flight {format_bytes(p.in_flight)}" if p.in_flight else ""
        return (f"state {format_bytes(p.state['device'])} + {p.n_layer} blocks x {format_bytes(p.held)} held under "
                f"{case.policy!r}{flight} + the block in backward {format_bytes(p.full)} + gradients on their way "
                f"{format_bytes(p.grads)} + the head's inputs {format_bytes(p.head)} + the logits "
                f"{format_bytes(p.logits)}")
    if tier == "host":
        return (f"offloaded state {format_bytes(p.state['host'])} + {p.n_layer} blocks x {format_bytes(p.offloaded)} "
                "of offloaded activations")
    return f"the swapper's files and the streamed weights' home {format_bytes(p.state['nvme'])}"


@grader("9.1", rebuilds=(
    "minioffload.planner.search.search",
    "minioffload.planner.search._configs",
    "minioffload.planner.search._evaluate",
    "minioffload.planner.search._state_bytes",
    "minioffload.planner.search._problem",
))
def configuration(fn: Callable) -> str:
    """fn(model, hw, limits) -> a configuration dict: it must fit every tier and reach 90% of the fastest."""
    reached = []
    for index, (model, hw, limits) in enumerate(_setups()):
        where = f"configure(<{model}>, {hw.name}, <batch {limits.batch}, {limits.precision}>)"
        config = fn(model, hw, limits)
        why = _refused(config, limits)
        if why:
            raise AssertionError(f"{where} returned {config!r:.200}: {why}")
        case = Case(model, hw, limits, **config)
        p = parts(case)
        capacity = limits.capacity(hw)
        need = p.need()
        short = shortfall(need, capacity)
        for tier in TIERS:
            if short[tier]:
                raise AssertionError(
                    f"{where} returned {config}, which does not fit: {tier} needs {format_bytes(need[tier])} of "
                    f"{format_bytes(capacity[tier])}, {format_bytes(short[tier])} short. The planner's count: "
                    f"{_breakdown(case, p, tier)}")
        best, fast = fastest(index)
        speed = tokens_per_s(case)
        if speed < GOAL * best:
            raise AssertionError(
                f"{where} returned {config}: it fits, at {speed:,.0f} tokens/s; the fastest configuration with one "
                f"policy for every block reaches {best:,.0f} (weights on {fast.params_on}, optimizer on "
                f"{fast.optimizer_on}), and yours reaches {speed / best:.0%} of it ({GOAL:.0%} needed)")
        reached.append(speed / best)
    shown = ", ".join(f"{r:.0%}" for r in reached)
    return (f"your configurations fit every tier on all {len(reached)} models and machines and reach {shown} of the "
            f"fastest one-policy configuration's tokens/s ({GOAL:.0%} needed)")
