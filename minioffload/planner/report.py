"""Reading a planner's results: the best plan of each kind, the plans as a table, what a runner-up loses on, and why
nothing fits.

    print(table(best_per_family(plans)))
    why_slower(plans[0], plans[3])      # "1.31x the step (bound by nvme; nvme_read busy 3.2 s vs 0 s; ...)"

What this is not: the search (planner/search.py); it reads Plans and computes nothing new.
"""

from __future__ import annotations

import math

from ..units import format_bytes
from .plan import HOMES, Plan

NOT_WITH_RANKS = ("with ranks > 1 only the sharded engine is planned (train's shard): the optimizer offloaded, the "
                  "weights on every device, the synchronous update; streamed weights, the delayed and hybrid updates "
                  "and torch's AdamW on the device are not")


def why_slower(best: Plan, other: Plan) -> str:
    """What `other` loses on against `best`: its step over best's, and the lane whose busy time grew most."""
    ratio = other.step_s / best.step_s if best.step_s else math.inf
    grown = {lane: other.busy.get(lane, 0.0) - best.busy.get(lane, 0.0) for lane in {*best.busy, *other.busy}}
    lane = max(grown, key=grown.get) if grown else None
    reason = f"bound by {other.bound}" if other.bound != best.bound else f"also bound by {other.bound}"
    if lane is not None and grown[lane] > 0:
        reason += f"; {lane} busy {other.busy.get(lane, 0.0):.3g} s vs {best.busy.get(lane, 0.0):.3g} s"
    if other.grad_accum > best.grad_accum:
        reason += f"; {other.grad_accum} micro-batches of {other.micro_batch} vs {best.grad_accum}"
    acts = sum(p != "keep" for p in other.activations) - sum(p != "keep" for p in best.activations)
    if acts > 0:
        reason += f"; {acts} more blocks recompute or offload their activations"
    return f"{ratio:.2f}x the step ({reason})"


def best_per_family(plans: list[Plan]) -> list[Plan]:
    """The fastest plan of each (optimizer home, weights home) pair, fastest first: the runner-ups worth reading."""
    seen, out = set(), []
    for plan in plans:
        family = (plan.optimizer_on, plan.params_on, plan.delay, plan.gpu_fraction is not None)
        if family not in seen:
            seen.add(family)
            out.append(plan)
    return out


def table(plans: list[Plan]) -> str:
    """The plans as rows: predicted step, tokens/s, bytes per tier, the bound resource, the configuration."""
    lines = [f"{'#':>2} {'step s':>9} {'tokens/s':>10} {'device':>10} {'host':>10} {'nvme':>10}  {'bound':<12} plan"]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>2} {p.step_s:>9.3g} {p.tokens_per_s:>10,.0f} {format_bytes(p.memory['device']):>10} "
                     f"{format_bytes(p.memory['host']):>10} {format_bytes(p.memory['nvme']):>10}  {p.bound:<12} "
                     f"{p.describe()}")
    return "\n".join(lines)


def relative(short: dict[str, float], capacity) -> float:
    """How far a configuration is from fitting: its shortfalls over the capacities, summed."""
    return sum(max(0.0, v) / max(capacity[t] or 1.0, 1.0) for t, v in short.items())


def nothing_fits(model, hw, limits, capacity, short: dict[str, float], closest) -> str:
    """plan.search's message when nothing fits: what the closest configuration (a plan._Config, or None) lacks."""
    lacking = [f"{format_bytes(short[t])} more {t} memory" if t != "nvme" else f"{format_bytes(short[t])} more NVMe"
               for t in HOMES if short.get(t, 0) > 0]
    have = ", ".join(f"{t} {format_bytes(v)}" if v is not None else f"{t} unbounded" for t, v in capacity.items())
    what = ""
    if closest is not None:
        what = (f" (optimizer on {closest.optimizer_on}, weights on {closest.params_on}, micro-batch "
                f"{closest.micro_batch})")
    hint = ""
    if short.get("host", 0) > 0 and closest is not None and closest.optimizer_on != "device":
        hint = (" The offloaded optimizer keeps its state in pinned host memory unless it is on NVMe, and every "
                "gradient there (6 B/param for 16-bit weights) unless they are on NVMe with it (grads_on='nvme').")
    if limits.ranks > 1:
        hint += f" With {limits.ranks} ranks each rank's memory is its own share; {NOT_WITH_RANKS}."
    return (f"no configuration of the runtime trains the {model} on {hw.name} with a batch of {limits.batch} "
            f"({have}): the closest{what} needs {' and '.join(lacking) or 'more memory'}.{hint} Give more memory "
            "(--host-gb, --nvme-gb), a smaller batch or context, or a larger device")
