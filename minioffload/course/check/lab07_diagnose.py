"""Grader for Lab 7's diagnosis task (7.4): activation policies that run out of their budget or cost far more time
than planned, the cause named from the ledger and the copies, and fixed with a policy per block.

The learner gets the profile and the block shape a plan was made with, the plan (a policy per block), the device's
budget for activations, and what the run measured: the bytes each block held between its forward and its backward
(the device's ledger), and each offloaded block's copies (bytes, tensors and seconds each way). The measurements are
the cost model's (predict/activation_cost.py) on a hidden truth. Three causes, two cases of each:

    unfused   the model runs its attention written out (softmax(q k^T) v), not fused as the plan assumed: a kept block
              holds the a s^2 scores too, and an offloaded one moves them
    link      the copies run slower than the profile's link (a card in a narrower slot, a link shared with the
              optimizer's traffic): offloading no longer hides
    budget    the plan was made for a smaller budget than the device has: it recomputes or offloads blocks it could
              keep

The fix is a policy per block, graded by running it through the cost model under the hidden truth: the blocks must
hold at most the budget, and add at most FIX_SHARE more time than the best policies per block do there (the blocks
are alike, so the best is found by counting how many blocks take each policy). More than one fix can be right. A
wrong cause fails with why it does not fit the measurements. Verdicts are the cost model's arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ...machine import profiles
from ...predict.activation_cost import POLICIES, BlockShape, PolicyCost, best_policy, policy_costs
from .grading import grader

CAUSES = ("unfused", "link", "budget")
FIX_SHARE = 0.05  # the added time a fix may have over the best policies per block, as a share of theirs
MiB, GiB = 2**20, 2**30


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    preset: str
    block: BlockShape  # as the plan saw it: attention fused
    layers: int
    budget: float  # bytes the device has for activations
    planned_budget: float  # bytes the plan was made for
    link: float = 1.0  # the hidden truth: the link's rate as a factor on the profile's


_A = BlockShape(seq_len=2048, batch_size=4, hidden=4096, heads=32)
_B = BlockShape(seq_len=4096, batch_size=2, hidden=5120, heads=40)

CASES = (
    Case("link", "a100-pcie", _A, 24, 12 * GiB, 12 * GiB, link=1 / 3),
    Case("unfused", "a100-pcie", _A, 24, 12 * GiB, 12 * GiB),
    Case("budget", "a100-pcie", _B, 32, 20 * GiB, 6 * GiB),
    Case("unfused", "h100-sxm", _B, 40, 30 * GiB, 30 * GiB),
    Case("budget", "h100-sxm", _A, 32, 24 * GiB, 8 * GiB),
    Case("link", "h100-sxm", _B, 40, 24 * GiB, 24 * GiB, link=1 / 2),
)

EXAMPLE = Case("link", "a100-pcie", _B, 24, 10 * GiB, 10 * GiB, link=0.4)  # the lab's worked run, not graded


def _truth(case: Case) -> tuple[BlockShape, profiles.Hardware]:
    hw = profiles.preset(case.preset)
    hw = hw.replace(link_h2d=hw.link_h2d * case.link, link_d2h=hw.link_d2h * case.link)
    return dataclasses.replace(case.block, fused_attention=case.cause != "unfused"), hw


def least_time(costs: dict[str, PolicyCost], layers: int, budget: float) -> float:
    """The least added time of `layers` alike blocks whose policies hold at most `budget` in all (inf when none
    fits): every way of sharing the blocks out among the policies, counted."""
    names = list(costs)

    def best(i: int, blocks: int, room: float) -> float:
        cost = costs[names[i]]
        if i == len(names) - 1:
            return blocks * cost.extra_s if blocks * cost.device_bytes <= room else math.inf
        return min(n * cost.extra_s + best(i + 1, blocks - n, room - n * cost.device_bytes)
                   for n in range(blocks + 1) if n * cost.device_bytes <= room)
    return best(0, layers, budget)


def _plan(case: Case) -> list[str]:
    """The plan as it was made: the profile, the block as fused, the planned budget; the kept blocks first."""
    costs = policy_costs(case.block, profiles.preset(case.preset))
    plan, room = [], case.planned_budget
    for left in range(case.layers, 0, -1):
        # the fastest policy for this block that leaves the others room for their cheapest
        floor = (left - 1) * min(c.device_bytes for c in costs.values())
        pick = best_policy(None, None, room - floor, costs=costs)
        plan.append(pick.policy)
        room -= pick.device_bytes
    return plan


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the plan and what the run measured."""
    block, hw = _truth(case)
    costs, planned = policy_costs(block, hw), policy_costs(case.block, profiles.preset(case.preset))
    policies = _plan(case)
    copies = []
    for i, policy in enumerate(policies):
        if costs[policy].link_bytes:
            tensors = block.saved_tensors() if policy == "offload" else 1
            for direction, rate in (("d2h", hw.link_d2h), ("h2d", hw.link_h2d)):
                nbytes = costs[policy].link_bytes
                copies.append({"block": i, "direction": direction, "tensors": tensors, "nbytes": nbytes,
                               "seconds": tensors * hw.link_latency + nbytes / rate})
    return {"block": case.block, "layers": case.layers, "policies": policies, "budget_bytes": case.budget,
            "ledger": [costs[p].device_bytes for p in policies], "copies": copies,
            "planned_s": sum(planned[p].extra_s for p in policies),
            "measured_s": sum(costs[p].extra_s for p in policies)}


def example() -> tuple[profiles.Hardware, dict]:
    """The profile and the run the lab shows before the task (a case the grader does not use)."""
    return profiles.preset(EXAMPLE.preset), run_of(EXAMPLE)


def link_rate(copies: list[dict], latency: float) -> float:
    """Bytes per second the copies moved once each tensor's copy latency is taken off (0 without copies)."""
    seconds = sum(c["seconds"] - c["tensors"] * latency for c in copies)
    return sum(c["nbytes"] for c in copies) / seconds if seconds > 0 else 0.0


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause, from what the run measured."""
    hw = profiles.preset(case.preset)
    planned = policy_costs(case.block, hw)
    held, counted = sum(run["ledger"]), sum(planned[p].device_bytes for p in run["policies"])
    if named == "link":
        rate = link_rate(run["copies"], hw.link_latency)
        if not rate:
            return "no block's activations crossed the link in this run"
        return (f"the copies moved {rate / 1e9:.1f} GB/s once each copy's latency is taken off, the profile's "
                f"{hw.link_h2d / 1e9:.1f}: the link is as fast as planned")
    if named == "unfused":
        return (f"the blocks held {held / GiB:.2f} GiB, what the planned block's policies count "
                f"({counted / GiB:.2f} GiB): no block kept more than planned")
    room = run["budget_bytes"] - held
    if room < 0:
        return f"the blocks held {held / GiB:.2f} GiB, over the {run['budget_bytes'] / GiB:.2f} GiB budget"
    return (f"the blocks held {held / GiB:.2f} GiB of the {run['budget_bytes'] / GiB:.2f} GiB budget: the "
            f"{room / MiB:.0f} MiB left is not room for one more kept block ({planned['keep'].device_bytes / MiB:.0f} "
            "MiB)")


@grader("7.4", nothing_to_refuse=(
    "no runtime function diagnoses a run's activation policies; the fix is graded by the cost model under the hidden "
    "truth"
))
def diagnose(fn: Callable) -> str:
    """fn(hw, run, price) -> (cause, policies), for each case."""
    for number, case in enumerate(CASES, 1):
        run, hw = run_of(case), profiles.preset(case.preset)
        answer = fn(hw, dict(run, policies=list(run["policies"]), ledger=list(run["ledger"]),
                             copies=[dict(c) for c in run["copies"]]), policy_costs)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_activations returned {answer!r}; return (cause, policies), e.g. ('link', "
            "['keep', 'recompute', ...])")
        cause, policies = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run)}")
        assert isinstance(policies, (list, tuple)) and len(policies) == case.layers, (
            f"case {number}: return one policy per block, {case.layers} of them, not {policies!r:.80}")
        unknown = sorted({p for p in policies if p not in POLICIES}, key=str)
        assert not unknown, (f"case {number}: {', '.join(map(repr, unknown))} is not a policy; choose among "
                             f"{', '.join(POLICIES)}")
        block, true_hw = _truth(case)
        costs = policy_costs(block, true_hw)
        held, added = sum(costs[p].device_bytes for p in policies), sum(costs[p].extra_s for p in policies)
        assert held <= case.budget, (
            f"case {number} ({case.cause}, rightly): your policies hold {held / GiB:.2f} GiB on the device as it is, "
            f"over the {case.budget / GiB:.2f} GiB budget (a kept block holds {costs['keep'].device_bytes / MiB:.0f} "
            "MiB there)")
        least = least_time(costs, case.layers, case.budget)
        assert added <= least * (1 + FIX_SHARE), (
            f"case {number} ({case.cause}, rightly): your policies add {1e3 * added:.0f} ms on the machine as it is, "
            f"where the best policies within the budget add {1e3 * least:.0f} ms (at most {FIX_SHARE:.0%} more "
            "allowed): price them on the machine as it is, not as the profile says")
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix holds at most its budget and "
            f"adds at most {FIX_SHARE:.0%} more time than the best policies per block on the machine as it is")
