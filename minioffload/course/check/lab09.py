"""Graders for Lab 9, "Planning the run": what one configuration needs on each tier and what it lacks (9.1).

Task 9.2 (a plan's tokens per second, the planner's objective) is graded in lab09_objective.py, Task 9.3 (the exact
choice of activation policies and hybrid split) in lab09_search.py.

Task 9.1 is checked against the planner's own count, asked through its parts: `plan._state_bytes` (the weights,
gradients and optimizer state of a placement, by predict/memory.py's footprint, engine_bytes or streamed_bytes) and
`plan._problem` (each activation policy's bytes per block and the offloaded set in flight, and what the planner adds
outside the blocks: the block in backward, the head's inputs and the logits). When the learner's bytes equal what a
plausible mistake gives, the verdict names it. Verdicts carry counts and sizes, never timings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from ...machine import profiles
from ...planner import search as plan
from ...planner.plan import ModelSpec
from ...predict import memory
from ...predict.activation_cost import POLICIES
from ...units import GB, GiB, MiB
from .grading import grader

TIERS = ("device", "host", "nvme")
PLACEMENTS = (("device", "device"), ("host", "device"), ("nvme", "device"), ("host", "host"), ("host", "nvme"),
              ("nvme", "host"), ("nvme", "nvme"))  # (optimizer_on, params_on)
MICRO_BATCHES = (1, 4)


def _setups() -> tuple:
    """(model, machine, limits): a course GPT in fp32 on a small device, and GPT-3 shapes on presets with their host
    memory, a host limit and NVMe limits, so that every tier falls short somewhere."""
    return (
        (ModelSpec(6, 128, 4, 74, 128), profiles.preset("laptop"), plan.Limits(device_bytes=24 * MiB,
                                                                                precision="fp32")),
        (ModelSpec.of_params(7e9), profiles.preset("rtx4090"), plan.Limits(host_bytes=64 * GiB, nvme_bytes=2000 * GB)),
        (ModelSpec.of_params(13e9), profiles.preset("h100-sxm"), plan.Limits()),
        (ModelSpec.of_params(70e9, 4096), profiles.preset("gh200"), plan.Limits(nvme_bytes=1000 * GB)),
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


@functools.lru_cache(maxsize=1)
def cases() -> tuple[Case, ...]:
    out = []
    for model, hw, limits in _setups():
        sizes = plan.subgroup_sizes(model)
        for optimizer_on, params_on in PLACEMENTS:
            for micro_batch in MICRO_BATCHES:
                for policy in POLICIES:
                    streamed = params_on != "device"
                    out.append(Case(model, hw, limits, optimizer_on, params_on, micro_batch, policy,
                                    len(out) % 4 if streamed else 0, sizes[len(out) % len(sizes)]))
    return tuple(out)


def shortfall(need: dict, capacity: dict) -> dict:
    return {t: max(0.0, need[t] - capacity[t]) if capacity[t] is not None else 0.0 for t in TIERS}


def _same(a, b) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1.0)


def _same_tiers(got: dict, want: dict) -> bool:
    return all(_same(got[t], want[t]) for t in TIERS)


def _with(p: Parts, **changes) -> dict:
    return dataclasses.replace(p, **changes).need()


def _mistakes(case: Case, p: Parts) -> list[tuple[str, dict]]:
    """(what the mistake is, the bytes per tier it gives), most specific first."""
    model, precision = case.model, case.limits.precision
    mb = 4 if precision == "fp32" else 2
    offloaded = case.optimizer_on != "device"
    out = [
        ("no logits: the last layer's logits and their gradient (fp32, plan.LOGIT_BYTES = 8 bytes per token and "
         "vocabulary entry: micro_batch x seq_len x vocab x 8) are on the device through the backward",
         _with(p, logits=0)),
        ("the logits at the model's dtype: they and their gradient are fp32, plan.LOGIT_BYTES = 8 bytes per token and "
         "vocabulary entry", _with(p, logits=p.logits * mb / 8)),
    ]
    out.append(("no head inputs: outside the blocks the final LayerNorm's input and the head's input (plan.HEAD_VALUES "
                "= 2 values of micro_batch x seq_len x d_model, at the activations' value size) stay on the device "
                "until the backward reaches them", _with(p, head=0)))
    if p.in_flight:  # first: for offload it equals the full set, and keep's cases (no set in flight) come first
        out.append(("no set in flight: with offload or offload_input, one block's set (its link_bytes) is still on "
                    "the device while its copy to the host runs beside the next block's forward, once for the stack",
                    _with(p, in_flight=0)))
    backward = ("the planner counts every block's held bytes (n_layer x held) and, on top, the full set of the block "
                "in backward (BlockShape.saved_bytes(): recomputed, or brought back from the host); "
                "memory.activation_bytes counts one block fewer, (n_layer - 1) x held + the full set")
    out.append((f"no block in backward: {backward}", _with(p, full=0)))
    if p.grads:
        out.append(("no gradients on their way: with the optimizer offloaded and the weights resident, the gradients "
                    "whose copies to the host have not run yet wait on the device, at most the largest subgroup's "
                    "(layout.pack_sizes) and the next one the backward makes, the largest tensor's "
                    "(plan.tensor_numels), at the model's value size", _with(p, grads=0)))
    if p.held and not _same(p.held, p.full):
        out.append((f"one block's held bytes short: {backward}",
                    _with(p, held=p.held * (model.n_layer - 1) / model.n_layer)))
    if p.offloaded:
        counted_on_device = ("the offloaded activations counted on the device: with offload or offload_input a block "
                             "holds nothing on the device between its forward and backward (but one set in flight); "
                             "its bytes wait in pinned host memory")
        out += [(counted_on_device, _with(p, held=p.offloaded, offloaded=0)),
                (counted_on_device, _with(p, held=p.offloaded, offloaded=0, in_flight=0)),
                ("the offloaded activations left out of host memory: each block's offloaded bytes wait in pinned "
                 "host memory (PolicyCost.link_bytes, n_layer of them)", _with(p, offloaded=0))]
    if precision == "fp32":
        low = parts(case, "mixed_bf16")
        out.append(("activations counted at 2 bytes per value: an fp32 model's activations are fp32, twice "
                    "Korthikanti et al.'s 16-bit count (BlockShape(..., value_bytes=4))",
                    _with(p, held=low.held, offloaded=low.offloaded, in_flight=low.in_flight, full=low.full,
                          head=low.head)))
    if offloaded:
        state = dict(p.state)
        state["device"] += model.num_params * mb
        out.append(("gradients counted on the device: with the optimizer offloaded, each gradient leaves the device "
                    "as the backward makes it and is summed in pinned host memory (memory.engine_bytes counts it "
                    "there)", _with(p, state=state)))
        on_device = plan._state_bytes(model, dataclasses.replace(case.config, optimizer_on="device",
                                                                 params_on="device"), precision)
        out.append(("the optimizer counted on the device: with optimizer_on 'host' or 'nvme' the device keeps the "
                    "weights it computes with, not the gradients, master weights and Adam's state",
                    _with(p, state=on_device)))
    if case.optimizer_on == "nvme":
        host = plan._state_bytes(model, dataclasses.replace(case.config, optimizer_on="host"), precision)
        out.append(("the optimizer on NVMe counted as on the host: pass optimizer_on='nvme' to engine_bytes, "
                    "nvme=True to streamed_bytes (its state lives in the swapper's files; pinned host memory keeps "
                    "the gradients and three working sets)", _with(p, state=host)))
    if case.params_on != "device":
        resident = memory.engine_bytes(plan.tensor_numels(model), precision, optimizer_on=case.optimizer_on,
                                       subgroup_numel=case.subgroup_numel)
        out.append((f"streamed weights counted as resident: with params_on={case.params_on!r} the device holds the "
                    "resident weights and a window of prefetch + 1 blocks (plus one block's gradients), "
                    "memory.streamed_bytes", _with(p, state=resident)))
    return out


def _need_hint(case: Case, p: Parts, got: dict, want: dict) -> str:
    for what, wrong in _mistakes(case, p):
        if _same_tiers(got, wrong) and not _same_tiers(wrong, want):
            return what
    tier = next(t for t in TIERS if not _same(got[t], want[t]))
    if tier == "device":
        flight = f", one set in flight {p.in_flight:,.0f}" if p.in_flight else ""
        return (f"the device holds the state {p.state['device']:,.0f} (weights, and gradients and optimizer state "
                f"where the placement keeps them), {p.n_layer} blocks x {p.held:,.0f} held under {case.policy!r}"
                f"{flight}, the block in backward's full set {p.full:,.0f}, gradients on their way {p.grads:,.0f}, "
                f"the head's inputs {p.head:,.0f} and the logits {p.logits:,.0f}")
    if tier == "host":
        return (f"pinned host memory holds the offloaded state {p.state['host']:,.0f} and {p.n_layer} blocks x "
                f"{p.offloaded:,.0f} of offloaded activations")
    return f"NVMe holds the swapper's files and the streamed weights' home: {p.state['nvme']:,.0f}"


def _tiers(got, what: str, call: str) -> dict:
    if not isinstance(got, dict) or set(got) != set(TIERS):
        raise AssertionError(f"{call} returned {what} {got!r:.100}; expected a dict with the keys 'device', 'host' "
                             "and 'nvme' (bytes)")
    for tier, value in got.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AssertionError(f"{call} returned {what}[{tier!r}] = {value!r:.40}; expected a number of bytes")
    return got


def _short_hint(case: Case, need: dict, got: dict, want: dict) -> str:
    capacity = case.limits.capacity(case.hw)
    if any(v < 0 for v in got.values()):
        return "short names the bytes lacking: 0 where the tier has room, never a negative number"
    if capacity["nvme"] is None and _same(got["nvme"], need["nvme"]) and need["nvme"]:
        return "the limits' nvme capacity None means unbounded: nothing is ever short there"
    machine = {"device": case.hw.device_memory, "host": case.hw.host_memory, "nvme": None}
    if _same_tiers(got, shortfall(need, machine)):
        return ("the capacities are the limits' (limits.capacity(hw)): device_bytes or host_bytes set there override "
                "the machine's")
    return "short[tier] = need[tier] - capacity[tier] where that is positive, else 0; capacity from limits.capacity(hw)"


@grader("9.1", rebuilds=("minioffload.planner.search._state_bytes",))
def feasibility(fn: Callable) -> str:
    """fn(model, hw, limits, *, optimizer_on, params_on, micro_batch, policy, prefetch, subgroup_numel) -> (need,
    short): bytes per tier the configuration needs, and per tier the bytes it lacks (0 where it fits)."""
    short_cases = 0
    for case in cases():
        p = parts(case)
        want = p.need()
        call = case.call()
        got = fn(case.model, case.hw, case.limits, **case.kwargs())
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(f"{call} returned {got!r:.100}; expected (need, short): two dicts of bytes per tier")
        need, short = _tiers(got[0], "need", call), _tiers(got[1], "short", call)
        if not _same_tiers(need, want):
            shown = ", ".join(f"{t} {need[t]:,.0f}" for t in TIERS)
            wanted = ", ".join(f"{t} {want[t]:,.0f}" for t in TIERS)
            raise AssertionError(f"{call} needs {shown}; the planner counts {wanted}: "
                                 f"{_need_hint(case, p, need, want)}")
        want_short = shortfall(want, case.limits.capacity(case.hw))
        if not _same_tiers(short, want_short):
            shown = ", ".join(f"{t} {short[t]:,.0f}" for t in TIERS)
            wanted = ", ".join(f"{t} {want_short[t]:,.0f}" for t in TIERS)
            raise AssertionError(f"{call} returned short {shown}; it lacks {wanted}: "
                                 f"{_short_hint(case, need, short, want_short)}")
        short_cases += any(want_short.values())
    return (f"{len(cases())} configurations ({len(PLACEMENTS)} placements x {len(POLICIES)} policies x "
            f"{len(MICRO_BATCHES)} micro-batches, on {len(_setups())} models and machines): the bytes per tier are "
            f"the planner's, and the {short_cases} that do not fit lack what the planner says they lack")
