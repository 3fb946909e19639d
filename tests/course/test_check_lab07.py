"""Lab 7 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import dataclasses
import math

import torch
from grader_harness import mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

# Task 7.1 --------------------------------------------------------------------------------------


def hooks_with(*, wait_compute=True, keep=True, event=True, wait_left=True, to_device=True, skip_params=True,
               params_by_type=False, wait_arrived=True, min_numel=1024, adopt=True):
    """A correct make_hooks, with switches that turn it into one plausible mistake at a time."""
    def make_hooks(dev, d2h, h2d, params):
        weights = {p.untyped_storage().data_ptr() for p in params}

        def pack(tensor):
            if params_by_type and isinstance(tensor, torch.nn.Parameter):
                return tensor
            if skip_params and not params_by_type and tensor.untyped_storage().data_ptr() in weights:
                return tensor
            if tensor.numel() < min_numel:
                return tensor
            source = tensor.detach().contiguous()
            if adopt:
                dev.adopt(source, "activation")
            host = dev.host_empty(source.shape, source.dtype)
            if wait_compute:
                dev.stream_waits_for_compute(d2h)
            dev.copy(host, source, d2h)
            if keep:
                dev.keep_alive(source, d2h)
            left = dev.event()
            if event:
                left.record(d2h)
            return host, left

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            host, left = packed
            if not to_device:
                left.synchronize()
                return host
            if wait_left:
                h2d.wait(left)
            device = dev.empty(tuple(host.shape), host.dtype)
            dev.copy(device, host, h2d)
            arrived = dev.event()
            arrived.record(h2d)
            if wait_arrived:
                dev.compute_waits_for(arrived)
            return device

        return pack, unpack
    return make_hooks


# Task 7.2 --------------------------------------------------------------------------------------

MOVED = ("offload", "offload_input")


def plan_with(*, on_demand=True, with_input=True, nearest=False, during_any=False, forward=False):
    def fetch_plan(policies):
        moved = MOVED if with_input else ("offload",)
        fetched, plan = set(), []
        for i in reversed(range(len(policies))):
            if policies[i] not in moved and not during_any:
                continue
            if policies[i] in moved and i not in fetched and on_demand:
                plan.append((i, i))
                fetched.add(i)
            below = [j for j in range(i - 1, -1, -1) if policies[j] in moved] if nearest else [i - 1]
            if below and below[0] >= 0 and policies[below[0]] in moved and below[0] not in fetched:
                plan.append((i, below[0]))
                fetched.add(below[0])
        return plan[::-1] if forward else plan
    return fetch_plan


# Task 7.3 --------------------------------------------------------------------------------------

def choose_with(*, strict_budget=False, tie=True, least_memory=False, cost=False, ignore_budget=False):
    def choose(costs, budget):
        fits = [c for c in costs.values()
                if ignore_budget or (c.device_bytes < budget if strict_budget else c.device_bytes <= budget)]
        if not fits:
            return None
        key = ((lambda c: (c.device_bytes, c.extra_s)) if least_memory
               else (lambda c: (c.extra_s, c.device_bytes)) if tie else (lambda c: c.extra_s))
        best = min(fits, key=key)
        return best if cost else best.policy
    return choose


# Task 7.4 --------------------------------------------------------------------------------------

def diagnose_with(*, always=None, times_not_rates=False, profile_as_given=False, per_block_share=False,
                  keep_all=False, one_short=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def fastest(costs, layers, budget):  # (added time, policies) of the best shares of alike blocks
        if len(costs) == 1:
            c = costs[0]
            return (layers * c.extra_s, [c.policy] * layers) if layers * c.device_bytes <= budget else (math.inf, [])
        c, found = costs[0], (math.inf, [])
        for n in range(layers + 1):
            if n * c.device_bytes <= budget:
                time, rest = fastest(costs[1:], layers - n, budget - n * c.device_bytes)
                found = min(found, (time + n * c.extra_s, [c.policy] * n + rest))
        return found

    def diagnose_activations(hw, run, price):
        block, layers, budget = run["block"], run["layers"], run["budget_bytes"]
        planned = price(block, hw)
        copies = run["copies"]
        seconds = sum(c["seconds"] - c["tensors"] * hw.link_latency for c in copies)
        rate = sum(c["nbytes"] for c in copies) / seconds if copies else hw.link_h2d
        slow_copies = any(c["seconds"] > 1.2 * (c["tensors"] * hw.link_latency + planned[run["policies"][c["block"]]]
                                                .link_bytes / hw.link_h2d) for c in copies)
        true_block, true_hw = block, hw
        if any(held > planned[p].device_bytes for held, p in zip(run["ledger"], run["policies"], strict=True)):
            cause, true_block = "unfused", dataclasses.replace(block, fused_attention=False)
        elif rate < 0.8 * hw.link_h2d:
            cause, true_hw = "link", hw.replace(link_h2d=rate, link_d2h=rate)
        else:
            cause = "budget"
        if always:  # the fix still priced from the evidence: only the name is wrong
            cause = always
        elif times_not_rates and slow_copies:  # longer copies taken for a slower link
            cause = "link"
        if keep_all:
            return cause, ["keep"] * layers
        if profile_as_given:
            true_block, true_hw = block, hw
        costs = price(true_block, true_hw)
        if per_block_share:  # Task 7.3's choice for each block, on an equal share of the budget
            pick = min((c for c in costs.values() if c.device_bytes <= budget / layers),
                       key=lambda c: (c.extra_s, c.device_bytes))
            return cause, [pick.policy] * layers
        _, policies = fastest(list(costs.values()), layers, budget)
        return cause, policies[:-1] if one_short else policies
    return diagnose_activations


REFERENCE = {
    "7.1": hooks_with(),
    "7.2": plan_with(),
    "7.3": choose_with(),
    "7.4": diagnose_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("7.1", hooks_with(wait_compute=False), "dev.stream_waits_for_compute(d2h)"),
    ("7.1", hooks_with(wait_left=False), "the strict sim refused a copy"),
    ("7.1", hooks_with(event=False), "recorded no event on d2h"),
    ("7.1", hooks_with(keep=False), "dev.keep_alive(source, d2h)"),
    ("7.1", hooks_with(to_device=False), "unpack returned a host tensor"),
    ("7.1", hooks_with(wait_arrived=False), "dev.compute_waits_for(event)"),
    ("7.1", hooks_with(skip_params=False), "pack copied a parameter"),
    ("7.1", hooks_with(params_by_type=True), "compare storages"),
    ("7.1", hooks_with(min_numel=0), "stay on the device"),
    ("7.1", hooks_with(adopt=False), "dev.adopt(tensor)"),
    ("7.2", plan_with(on_demand=False), "its own first unpack fetches it"),
    ("7.2", plan_with(with_input=False), "offload_input blocks"),
    ("7.2", plan_with(nearest=True), "prefetches only block i-1"),
    ("7.2", plan_with(during_any=True), "nothing is fetched during its backward"),
    ("7.2", plan_with(forward=True), "backward runs from the last block"),
    ("7.3", choose_with(strict_budget=True), "equal included"),
    ("7.3", choose_with(tie=False), "on a tie take the one that holds less"),
    ("7.3", choose_with(least_memory=True), "adds less time"),
    ("7.3", choose_with(cost=True), "return the policy's name"),
    ("7.3", choose_with(ignore_budget=True), "over the budget"),
    ("7.4", diagnose_with(always="link"), "the link is as fast as planned"),
    ("7.4", diagnose_with(always="unfused"), "no block kept more than planned"),
    ("7.4", diagnose_with(always="budget"), "is not room for one more kept block"),
    ("7.4", diagnose_with(times_not_rates=True), "the link is as fast as planned"),
    ("7.4", diagnose_with(profile_as_given=True), "not as the profile says"),
    ("7.4", diagnose_with(per_block_share=True), "where the best policies within the budget add"),
    ("7.4", diagnose_with(keep_all=True), "over the 12.00 GiB budget"),
    ("7.4", diagnose_with(one_short=True), "return one policy per block, 24 of them"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("7.1", "7.2", "7.3", "7.4"))
