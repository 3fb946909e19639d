"""The planner: every configuration the runtime has, checked against the machine's memory and ranked by the step
model's tokens per second.

    plans = search(ModelSpec.of_params(70e9), profiles.preset("h100-sxm"), batch=8, host_bytes=512 * GB)
    plans[0].describe(), plans[0].step_s, plans[0].memory    # the best: where each state lives, its step, its bytes
    why_slower(plans[0], plans[3])                           # what a runner-up loses on
    train(plans[0].train_config())                           # a course GPT's plan runs as it was planned

The search enumerates where the optimizer lives (device: torch's AdamW; host: OffloadAdam; nvme: its NVMe tier, with
the gradients in host memory or on the drive too, tried only where the same plan with them in host memory does not
fit),
where the blocks' weights live (resident, or streamed from host, or from NVMe with the optimizer there too, as train
runs it), the prefetch depth, the delayed update,
the subgroup size and the micro-batch. For each, plan_milp solves exactly how many blocks take each activation
policy and how many subgroups are updated on the device, within the device and pinned host memory left; the
candidate is then predicted by stepmodel, and its bytes per tier counted by predict/memory.py's functions:

    device   the weights (all, or the streamed window), the engine's device state, the activations held
             (each block's policy, one block's full set in backward, and with an offload policy one block's set
             on its way to the host), the logits and their gradient, the gradients waiting for their copies
    host     OffloadAdam's pinned bytes (memory.engine_bytes / streamed_bytes), the offloaded activations
    nvme     the swapper's files and the streamed weights' home

Step time = stepmodel.predict for one micro-batch + the policies' added time (activation_cost) + per extra
micro-batch of accumulation its forward and backward, or its gradients' copy and host sum, or (streamed) its
second fetch of every block, whichever is longer.

What this is not: a promise. It ranks by a model whose misses are measured (bench/plan_accuracy.py), it knows only
the runtime's configurations, it counts no allocator fragmentation, and micro-batch size does not change the
model's FLOP/s utilisation here (on a real GPU small micro-batches run less efficiently).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..layout import pack_sizes
from ..machine.profiles import ADAM_BYTES_PER_PARAM, Hardware
from ..options import Placement, check_field
from ..predict import memory, stepmodel
from ..predict.activation_cost import POLICIES, BlockShape, policy_costs
from ..predict.shapes import tensor_numels
from ..predict.shards import ring_bytes, shard_sizes
from .milp import Option, Problem, solve
from .plan import HOMES, PLAN_PRECISIONS, ModelSpec, Plan
from .report import best_per_family, nothing_fits, relative, table, why_slower

PREFETCH_DEPTHS = (0, 1, 2, 3)
# policies in the order blocks take them: the first blocks' activations wait longest for their backward
POLICY_ORDER = ("offload_input", "offload", "recompute", "selective", "keep")
LOGIT_BYTES = 8  # per token and vocabulary entry: fp32 logits and their gradient
HEAD_VALUES = 2  # s b h values kept outside the blocks for backward: the final LayerNorm's input and the head's input


class NoPlanError(ValueError):
    """Nothing fits: `short` says, per tier, the least any configuration lacks (bytes)."""

    def __init__(self, message: str, short: dict[str, float]):
        super().__init__(message)
        self.short = short


@dataclass(frozen=True)
class Limits:
    """What the plan may use: bytes per tier (None: the profile's; nvme None: unbounded) and the batch.

    `ranks` > 1: that many processes, one device each (sharded offload): the optimizer state is split over them,
    weights, gradients and activations are on every device. The batch and every byte limit are per rank: each rank
    runs `batch` sequences per step, and `host_bytes`/`nvme_bytes` are one rank's share of the host (as a profile's
    figures are)."""

    batch: int = 8  # sequences per optimizer step and rank (micro_batch x grad_accum)
    device_bytes: float | None = None
    host_bytes: float | None = None
    nvme_bytes: float | None = None
    precision: str = "mixed_bf16"
    mfu: float = 0.4
    # host time per block per micro-batch for its forward and backward that FLOPs do not explain (kernel launches,
    # Python): 0.1 ms is ~30 launches of 3-4 us on a GPU (an estimate); the sim's is measured (fit_compute)
    block_overhead_s: float = 1e-4
    micro_batches: tuple[int, ...] | None = None  # None: every divisor of batch
    ranks: int = 1  # processes, one device and one share of the host each

    def __post_init__(self) -> None:
        check_field(Placement, "ranks", self.ranks)
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive int (sequences per step), got {self.batch!r}")
        for name in ("device_bytes", "host_bytes", "nvme_bytes"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a number of bytes >= 0 (or None), got {value!r}")
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PLAN_PRECISIONS)}, got {self.precision!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if not 0 <= self.block_overhead_s < math.inf:
            raise ValueError(f"block_overhead_s must be seconds >= 0, got {self.block_overhead_s!r}")
        if self.micro_batches is not None and any(self.batch % m for m in self.micro_batches):
            raise ValueError(f"every micro-batch must divide the batch ({self.batch}), got {self.micro_batches}")

    def capacity(self, hw: Hardware) -> dict[str, float | None]:
        return {"device": hw.device_memory if self.device_bytes is None else self.device_bytes,
                "host": hw.host_memory if self.host_bytes is None else self.host_bytes,
                "nvme": self.nvme_bytes}


@dataclass(frozen=True)
class _Config:
    """The discrete choices the planner enumerates (the MILP chooses the rest)."""

    optimizer_on: str
    params_on: str
    prefetch: int
    delay: bool
    hybrid: bool
    subgroup_numel: int
    micro_batch: int
    grads_on: str = "host"


def subgroup_sizes(model: ModelSpec) -> tuple[int, ...]:
    """Two subgroup sizes: the power of two that gives the optimizer about 8 subgroups (at most 2^26 elements, the
    NVMe tier's working sets stay a few GB), and 4x smaller (finer hybrid splits, more copies); never below 2^16,
    where the engine's per-subgroup Python work outweighs the subgroup's update."""
    coarse = 1 << max(16, min(26, round(math.log2(model.num_params / 8))))
    return tuple(sorted({coarse, max(1 << 16, coarse >> 2)}, reverse=True))


def _configs(model: ModelSpec, limits: Limits, capacity) -> list[_Config]:
    micro = limits.micro_batches or tuple(m for m in range(limits.batch, 0, -1) if limits.batch % m == 0)
    nvme_ok = capacity["nvme"] is None or capacity["nvme"] > 0
    out = []
    for optimizer_on in HOMES:
        if optimizer_on == "nvme" and not nvme_ok:
            continue
        if optimizer_on == "device" and limits.ranks > 1:
            continue  # train shards OffloadAdam's state; data parallel with torch's AdamW is not the runtime's
        for params_on in (("device",) if optimizer_on == "device" or limits.ranks > 1 else HOMES):
            # ranks > 1: the sharded engine keeps the weights on every device (plan_report.NOT_WITH_RANKS)
            if params_on == "nvme" and not nvme_ok:
                continue
            depths = PREFETCH_DEPTHS if params_on != "device" else (0,)
            resident_offload = optimizer_on == "host" and params_on == "device"
            splits = ((False, False), (True, False), (False, True)) if resident_offload else ((False, False),)
            for delay, hybrid in splits[:1] if limits.ranks > 1 else splits:  # the sharded update is synchronous
                sizes = subgroup_sizes(model) if optimizer_on != "device" else (1 << 22,)
                # with the state on NVMe, one process: the gradients wait in host memory, or on the drive too
                grads = ("host", "nvme") if optimizer_on == "nvme" and limits.ranks == 1 else ("host",)
                out += [_Config(optimizer_on, params_on, k, delay, hybrid, s, m, g)
                        for k in depths for s in sizes for m in micro for g in grads]
    return out


def _state_bytes(model: ModelSpec, c: _Config, precision: str, ranks: int = 1) -> dict[str, float]:
    """Bytes per tier of weights, gradients and optimizer state (no activations, no hybrid state), per rank: with
    the optimizer on the device every rank holds all of it (data parallel), offloaded the largest shard."""
    if c.optimizer_on == "device":
        fp = memory.footprint(precision, "adam", "device")
        return {"device": fp.bytes(model.num_params, "device"), "host": 0, "nvme": 0}
    if c.params_on == "device":
        return memory.engine_bytes(tensor_numels(model), precision, optimizer_on=c.optimizer_on, ranks=ranks,
                                   subgroup_numel=c.subgroup_numel, delay_updates_after=0 if c.delay else None,
                                   grads_on=c.grads_on)
    return memory.streamed_bytes(model.num_params, model.n_layer, model.resident_params, c.params_on, c.prefetch,
                                 precision, nvme=c.optimizer_on == "nvme", subgroup_numel=c.subgroup_numel,
                                 grads_on=c.grads_on)


def _problem(model: ModelSpec, hw: Hardware, c: _Config, limits: Limits, capacity, base: dict, accum: int
             ) -> tuple[Problem, float]:
    """The MILP of one configuration, and the device bytes outside it (the block in backward, the head's inputs, the
    logits, the gradients on their way to the host)."""
    value_bytes = 4 if limits.precision == "fp32" else 2
    block = BlockShape.of(model, c.micro_batch, value_bytes)  # its layout: a GPT's, or a Llama's (SwiGLU, GQA)
    costs = policy_costs(block, hw, limits.mfu)
    # an offloaded set waits on the device until its copy is done: the next block's forward runs beside it
    options = tuple(Option(p, costs[p].device_bytes, costs[p].link_bytes if p.startswith("offload") else 0,
                           costs[p].extra_s * accum, costs[p].link_bytes if p.startswith("offload") else 0)
                    for p in POLICY_ORDER)
    head = HEAD_VALUES * c.micro_batch * model.seq_len * model.d_model * value_bytes
    fixed = block.saved_bytes() + head + LOGIT_BYTES * c.micro_batch * model.seq_len * model.vocab
    host = math.inf if capacity["host"] is None else capacity["host"] - base["host"]
    sizes = pack_sizes(tensor_numels(model), c.subgroup_numel)
    if c.optimizer_on != "device" and c.params_on == "device" and limits.ranks == 1:
        # gradients waiting in backward for their copies to the host: OffloadAdam lets at most its largest
        # subgroup's wait, and the next is made before its hook can wait (engine/gradients.py); streamed plans
        # count theirs in memory.streamed_bytes
        fixed += (max(sizes) + max(tensor_numels(model))) * value_bytes
    # one subgroup's update on the CPU (Adam and the engine's host passes) and on the device (chapter 5's path)
    mb = value_bytes
    cpu_s = hw.subgroup_overhead + c.subgroup_numel / hw.cpu_adam_rate + c.subgroup_numel * (
        stepmodel.ACCUMULATE_BYTES + mb + stepmodel.CLIP_BYTES + stepmodel.ZERO_BYTES + (4 + mb) * (mb != 4)
    ) / hw.host_bandwidth
    device_s = c.subgroup_numel / hw.device_adam_rate + c.subgroup_numel * (
        stepmodel.DEVICE_PATH_BYTES + 2 * mb) / hw.device_bandwidth
    if hw.shared_host:
        device_s += c.subgroup_numel * ADAM_BYTES_PER_PARAM / hw.host_bandwidth
    problem = Problem(model.n_layer, options, capacity["device"] - base["device"] - fixed, host,
                      len(sizes), len(sizes) if c.hybrid else 0, 16.0 * max(sizes), cpu_s, device_s, hw.shared_host)
    return problem, fixed


def _compute_s(model: ModelSpec, hw: Hardware, c: _Config, limits: Limits) -> float:
    """One micro-batch's forward and backward: 6 N T FLOPs at the profile's peak x mfu, and each block's overhead."""
    flops = 6 * model.num_params * c.micro_batch * model.seq_len
    share = limits.ranks if hw.shared_host else 1  # the sim: every rank computes on the same cores
    return share * flops / (hw.peak_flops(limits.precision) * limits.mfu) + model.n_layer * limits.block_overhead_s


def fit_compute(seconds: dict[int, float], model: ModelSpec) -> tuple[float, float]:
    """(FLOP/s, block_overhead_s) from measured forward + backward seconds per micro-batch size ({micro_batch:
    seconds}, two sizes or more): a line, seconds = overhead + micro_batch x per_sequence. The FLOP/s is what forward
    and backward reach: set it as the profile's peak with mfu 1, or divide by the peak for mfu.

    The line is Theil-Sen's (the median of the pairwise slopes, then the median intercept), not least squares: on a
    shared machine one size measured during another process's burst would tilt a least-squares line, even negative."""
    if len(seconds) < 2:
        raise ValueError(f"fit_compute needs forward+backward times at two micro-batch sizes or more, got "
                         f"{sorted(seconds)}")
    import statistics
    from itertools import combinations

    points = sorted(seconds.items())
    slope = statistics.median((t2 - t1) / (m2 - m1) for (m1, t1), (m2, t2) in combinations(points, 2))
    if slope <= 0:
        raise ValueError(f"forward+backward did not grow with the micro-batch ({seconds}): measure on a quieter "
                         "machine or with larger micro-batches")
    intercept = statistics.median(t - slope * m for m, t in points)
    return 6 * model.num_params * model.seq_len / slope, max(intercept, 0.0) / model.n_layer


def _accumulation_s(model: ModelSpec, hw: Hardware, c: _Config, limits: Limits) -> float:
    """One more micro-batch of accumulation: its forward and backward, or what it must move, whichever is longer."""
    mb = 4 if limits.precision == "fp32" else 2
    compute = _compute_s(model, hw, c, limits)
    if c.optimizer_on == "device":
        return compute
    compute += model.num_tensors * (hw.grad_hook_overhead + hw.copy_overhead)  # every gradient's hook and copy again
    own = _own_fraction(model, c, limits.ranks)  # ranks > 1: each gradient reduced, its owner copies and sums it
    grads = own * model.num_params * mb / hw.link_d2h
    summed = own * model.num_params * (stepmodel.ACCUMULATE_BYTES + mb) / hw.host_bandwidth
    moves = [grads, summed, ring_bytes("reduce", model.num_params * mb, limits.ranks) / hw.interconnect]
    if c.grads_on == "nvme":  # each subgroup's partial sum read back from the drive and written again
        moves.append(model.num_params * 4 * (1 / hw.nvme_read + 1 / hw.nvme_write))
    if c.params_on != "device":  # every block comes up again (forward and backward), as stepmodel fetches them
        fetches = streamed_fetches(model.n_layer, c.prefetch)
        compute += fetches * hw.fetch_overhead  # the streamer's hooks fetch and release each on the compute thread
        block = model.block_params * mb
        moves.append(fetches * (model.block_tensors * hw.link_latency + block / hw.link_h2d))  # a copy per tensor
        if c.params_on == "nvme":
            moves.append(fetches * (hw.nvme_read_overhead + block / hw.nvme_read))
    return compute + summed if hw.shared_host else max(compute, *moves)


def streamed_fetches(n_layer: int, prefetch: int) -> int:
    """Blocks fetched in one micro-batch's forward and backward with streamed weights: every block twice, but for
    the last (prefetch + 1) // 2, which stay on the device from their forward to their backward (model/streaming.py)."""
    return 2 * n_layer - (prefetch + 1) // 2


def _own_fraction(model: ModelSpec, c: _Config, ranks: int) -> float:
    """The share of the parameters the busiest rank owns (1 with one rank)."""
    if ranks == 1:
        return 1.0
    sizes = pack_sizes(tensor_numels(model), c.subgroup_numel)
    return max(shard_sizes(sizes, ranks)) / sum(sizes)


def _evaluate(model: ModelSpec, hw: Hardware, c: _Config, limits: Limits, capacity, name: str
              ) -> tuple[Plan | None, dict[str, float]]:
    """A plan for one configuration, or None and the bytes it lacks per tier."""
    accum = limits.batch // c.micro_batch
    base = _state_bytes(model, c, limits.precision, limits.ranks)
    problem, fixed = _problem(model, hw, c, limits, capacity, base, accum)
    lightest = min(o.device_bytes * model.n_layer + o.in_flight_bytes for o in problem.options)
    short = {"device": base["device"] + fixed + lightest - capacity["device"],
             "host": base["host"] - capacity["host"] if capacity["host"] is not None else -1.0,
             "nvme": base["nvme"] - capacity["nvme"] if capacity["nvme"] is not None else -1.0}
    if max(short.values()) > 0:
        return None, short
    solution = solve(problem)
    if solution is None:  # the activations that fit on the device need more pinned host memory than is left
        return None, {"device": -1.0, "host": min(o.host_bytes for o in problem.options if
                                                   o.device_bytes * model.n_layer <= problem.device_budget)
                      * model.n_layer - problem.host_budget, "nvme": -1.0}
    gpu_fraction = solution.resident / problem.subgroups if solution.resident else None
    if gpu_fraction is not None:  # the engine's exact bytes with that split
        base = memory.engine_bytes(tensor_numels(model), limits.precision, subgroup_numel=c.subgroup_numel,
                                   gpu_fraction=gpu_fraction)
    policies = solution.policies(POLICY_ORDER)
    held = problem.device_bytes(solution.counts, 0)
    offloaded = sum(o.host_bytes * solution.counts.get(o.name, 0) for o in problem.options)
    draft = Plan(model, name, limits.precision, c.micro_batch, accum, c.optimizer_on, c.params_on, policies, c.prefetch,
                 c.subgroup_numel, c.delay, gpu_fraction, ranks=limits.ranks, grads_on=c.grads_on)  # predicted next
    predicted_s, predicted_busy, predicted_bound = _predicted(
        model.workload(c.micro_batch * model.seq_len, limits.precision), hw, draft.step_config(limits.mfu))
    extra = sum(o.extra_s * solution.counts.get(o.name, 0) for o in problem.options)  # already x accum
    overhead = model.n_layer * limits.block_overhead_s  # the first micro-batch's (predict counts FLOPs only)
    step_s = predicted_s + overhead + extra + (accum - 1) * _accumulation_s(model, hw, c, limits)
    busy = dict(predicted_busy)  # one micro-batch's lanes; the others' compute and gradient copies added
    busy["compute"] = busy.get("compute", 0.0) + overhead + extra + (accum - 1) * _compute_s(model, hw, c, limits)
    if c.optimizer_on != "device" and accum > 1:
        mb = 2 if limits.precision != "fp32" else 4
        busy["d2h"] = busy.get("d2h", 0.0) + (accum - 1) * _own_fraction(model, c, limits.ranks) * model.num_params \
            * mb / hw.link_d2h
        if limits.ranks > 1:
            busy["net"] = busy.get("net", 0.0) + (accum - 1) * ring_bytes("reduce", model.num_params * mb,
                                                                         limits.ranks) / hw.interconnect
    used = {"device": base["device"] + held + fixed, "host": base["host"] + offloaded, "nvme": base["nvme"]}
    bound = predicted_bound
    if accum > 1:  # the other micro-batches' lanes count: the busiest resource (stepmodel's: one drive, one host)
        per_resource: dict[str, float] = {}
        for lane, seconds in busy.items():
            resource = stepmodel.resource_of(lane, hw)
            per_resource[resource] = per_resource.get(resource, 0.0) + seconds
        bound = max(per_resource, key=per_resource.get)
    plan = dataclasses.replace(draft, step_s=step_s, memory={k: round(v) for k, v in used.items()}, bound=bound,
                               busy=busy, capacity=dict(capacity))
    return plan, {}


@functools.lru_cache(maxsize=4096)
def _predicted(work: stepmodel.Workload, hw: Hardware, config: stepmodel.StepConfig) -> tuple[float, dict, str]:
    """stepmodel's step of one configuration: its seconds, busy seconds per lane and bound. Searches under other
    limits (the what-if tables, the explorers' grids of capacities) meet the same configurations again; each is
    predicted once per process. (Workload, Hardware and StepConfig are frozen: equal ones predict equally.)"""
    predicted = stepmodel.predict(work, hw, config)
    return predicted.step_s, dict(predicted.busy), predicted.bound


def prediction(p: Plan, hw: Hardware, limits: Limits | None = None) -> stepmodel.Prediction:
    """stepmodel's prediction of one micro-batch's step of plan `p` (its timeline, for a figure beside a measured
    trace); `p.step_s` adds the policies' time and the other micro-batches to it."""
    limits = limits or Limits(batch=p.micro_batch * p.grad_accum, precision=p.precision, ranks=p.ranks)
    return stepmodel.predict(p.model.workload(p.micro_batch * p.model.seq_len, p.precision), hw,
                             p.step_config(limits.mfu))


def step_seconds(p: Plan, hw: Hardware, limits: Limits) -> float:
    """Plan `p`'s step with its choices kept, its activation policies included, as the planner predicts it on `hw`
    under `limits`: `p.step_s` again with the profile and limits it was planned with; with another (a compute rate
    measured later, as bench/plan_accuracy.py does beside its runs), what the same plan's step comes to then."""
    value_bytes = 4 if p.precision == "fp32" else 2
    block = BlockShape.of(p.model, p.micro_batch, value_bytes)
    costs = policy_costs(block, hw, limits.mfu)
    c = _Config(p.optimizer_on, p.params_on, p.prefetch, p.delay, p.gpu_fraction is not None, p.subgroup_numel,
                p.micro_batch, p.grads_on)
    return (prediction(p, hw, limits).step_s + p.model.n_layer * limits.block_overhead_s
            + p.grad_accum * sum(costs[a].extra_s for a in p.activations)
            + (p.grad_accum - 1) * _accumulation_s(p.model, hw, c, limits))


def search(model: ModelSpec, hw: Hardware, limits: Limits | None = None,
           progress: Callable[[int, int], None] | None = None) -> list[Plan]:
    """Every configuration that fits, fastest first (predicted tokens/s). Raises NoPlanError, naming the bytes
    missing per tier, when none fits. `progress(done, total)` is called as configurations are tried."""
    limits = limits or Limits()
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a profiles.Hardware (profiles.preset(name) or profiles.probe()), got "
                        f"{type(hw).__name__}")
    capacity = limits.capacity(hw)
    configs = _configs(model, limits, capacity)
    plans, short, closest = [], {tier: math.inf for tier in HOMES}, None
    fitted: set[tuple] = set()  # (the configuration but its micro-batch): micro-batches are tried largest first
    host_fits: set[_Config] = set()  # configurations with the gradients in host memory that fit
    for done, c in enumerate(configs, 1):
        key = dataclasses.replace(c, micro_batch=0)
        # gradients on the drive only where host memory needs it: the same plan with them in host memory moves
        # less and fits, so it is at least as fast (but for activations that more host memory could have offloaded)
        needed = c.grads_on == "host" or dataclasses.replace(c, grads_on="host") not in host_fits
        if needed and (key not in fitted or len([p for p in plans if _key(p) == key]) < 2):
            plan, lacks = _evaluate(model, hw, c, limits, capacity, hw.name)
            if plan is None:
                if relative(lacks, capacity) < relative(short, capacity):
                    short, closest = {tier: max(0.0, v) for tier, v in lacks.items()}, c
            else:
                fitted.add(key)
                plans.append(plan)
                if c.grads_on == "host":
                    host_fits.add(c)
        if progress is not None:
            progress(done, len(configs))
    if not plans:
        raise NoPlanError(nothing_fits(model, hw, limits, capacity, short, closest), short)
    unique = {}
    for plan in plans:  # the hybrid solver may choose no split: the same plan as without it
        unique.setdefault((plan.describe(), plan.subgroup_numel), plan)
    return sorted(unique.values(), key=lambda p: (-p.tokens_per_s, p.memory["device"]))


def _key(plan: Plan) -> _Config:
    return _Config(plan.optimizer_on, plan.params_on, plan.prefetch, plan.delay, plan.gpu_fraction is not None,
                   plan.subgroup_numel, 0, plan.grads_on)


def train_config(plan: Plan, **overrides):
    """The TrainConfig that runs `plan`: `plan.train_config(**overrides)` (planner/plan.py)."""
    return plan.train_config(**overrides)


__all__ = ["Limits", "ModelSpec", "NoPlanError", "Plan", "POLICIES", "best_per_family", "fit_compute", "prediction",
           "search", "step_seconds", "streamed_fetches", "table", "train_config", "why_slower"]
