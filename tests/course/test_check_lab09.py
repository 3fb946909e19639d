"""Lab 9 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import functools
import itertools
import statistics

from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.layout import STATE_BYTES_PER_PARAM, device_subgroups
from minioffload.planner import search as plan
from minioffload.planner.milp import Solution, brute_force, solve
from minioffload.planner.plan import Plan
from minioffload.predict import memory, stepmodel
from minioffload.predict.activation_cost import POLICIES, BlockShape, policy_costs

# Task 9.1 --------------------------------------------------------------------------------------


def needs(model, hw, limits, optimizer_on, params_on, micro_batch, policy, prefetch, subgroup_numel, *,
          logits=True, grads_waiting=True, backward_block=True):
    """Bytes per tier, counted as the planner counts them (switches leave one part out)."""
    precision = limits.precision
    value_bytes = 4 if precision == "fp32" else 2
    if optimizer_on == "device":
        state = {"device": memory.footprint(precision, "adam", "device").bytes(model.num_params, "device"),
                 "host": 0, "nvme": 0}
    elif params_on == "device":
        state = memory.engine_bytes(plan.tensor_numels(model), precision, optimizer_on=optimizer_on,
                                    subgroup_numel=subgroup_numel)
    else:
        state = memory.streamed_bytes(model.num_params, model.n_layer, model.resident_params, params_on, prefetch,
                                      precision, nvme=optimizer_on == "nvme", subgroup_numel=subgroup_numel)
    block = BlockShape(model.seq_len, micro_batch, model.d_model, model.n_head, value_bytes)
    cost = policy_costs(block, hw)[policy]
    offloaded = cost.link_bytes if policy.startswith("offload") else 0
    waiting = 0
    if grads_waiting and optimizer_on != "device" and params_on == "device":
        numels = plan.tensor_numels(model)
        waiting = (max(plan.pack_sizes(numels, subgroup_numel)) + max(numels)) * value_bytes
    head = plan.HEAD_VALUES * micro_batch * model.seq_len * model.d_model * value_bytes
    logit_bytes = plan.LOGIT_BYTES * micro_batch * model.seq_len * model.vocab if logits else 0
    device = (state["device"] + model.n_layer * cost.device_bytes + offloaded + waiting + head + logit_bytes
              + block.saved_bytes() * backward_block)
    return {"device": device, "host": state["host"] + model.n_layer * offloaded, "nvme": state["nvme"]}


@functools.cache
def step_of(model, hw, limits, optimizer_on, params_on, micro_batch, policy, prefetch, subgroup_numel):
    """plan.step_seconds of a one-policy configuration (cached: the answers below try the same ones)."""
    p = Plan(model, hw.name, limits.precision, micro_batch, limits.batch // micro_batch, optimizer_on, params_on,
             (policy,) * model.n_layer, prefetch, subgroup_numel)
    return plan.step_seconds(p, hw, limits)


HOME_PAIRS = (("device", "device"), ("host", "device"), ("host", "host"), ("host", "nvme"), ("nvme", "device"),
              ("nvme", "host"), ("nvme", "nvme"))


def configure_with(*, logits=True, grads_waiting=True, backward_block=True, host_tier=True, micro_batch=None,
                   shape=dict):
    """A right configure(): every configuration, counted, the fastest that fits; switches make one mistake each."""
    def configure(model, hw, limits):
        capacity = limits.capacity(hw)
        if not host_tier:
            capacity = {**capacity, "host": None}
        pairs = [h for h in HOME_PAIRS if capacity["nvme"] != 0 or "nvme" not in h]
        micros = [micro_batch] if micro_batch else [m for m in range(1, limits.batch + 1) if limits.batch % m == 0]
        best, best_speed = None, 0.0
        for (optimizer_on, params_on), micro, policy in itertools.product(pairs, micros, POLICIES):
            for prefetch, numel in itertools.product((1, 3) if params_on != "device" else (0,),
                                                     plan.subgroup_sizes(model)):
                config = {"optimizer_on": optimizer_on, "params_on": params_on, "micro_batch": micro,
                          "policy": policy, "prefetch": prefetch, "subgroup_numel": numel}
                need = needs(model, hw, limits, **config, logits=logits, grads_waiting=grads_waiting,
                             backward_block=backward_block)
                if any(capacity[t] is not None and need[t] > capacity[t] for t in need):
                    continue
                speed = limits.batch * model.seq_len / step_of(model, hw, limits, *config.values())
                if speed > best_speed:
                    best, best_speed = config, speed
        return shape(best.items()) if shape is dict else tuple(best.values())
    return configure


# Task 9.2 --------------------------------------------------------------------------------------

def bound_with(*, chain=True, hooks=True, hybrid=True, shared_adds=True, total=False, compute_only=False,
               seconds_and_lane=False):
    """A right lower bound, with switches that turn it into one plausible mistake at a time."""
    def step_bound(p, hw, limits):
        model, accum = p.model, p.grad_accum
        mb = 4 if p.precision == "fp32" else 2
        n = model.num_params
        block = BlockShape(model.seq_len, p.micro_batch, model.d_model, model.n_head, mb, model.fused_attention)
        costs = policy_costs(block, hw, limits.mfu)
        fb = 6 * n * p.micro_batch * model.seq_len / (hw.peak_flops(p.precision) * limits.mfu)
        outside = model.n_layer * limits.block_overhead_s + sum(costs[a].extra_s for a in p.activations)
        if p.optimizer_on == "device" or compute_only:
            return accum * (fb + outside) + (n / hw.device_adam_rate if p.optimizer_on == "device" else 0)
        streamed = p.params_on != "device"
        groups = model.workload(p.micro_batch * model.seq_len, p.precision).subgroups(p.subgroup_numel)
        on_device = set().union(*device_subgroups(len(groups), p.gpu_fraction if hybrid else None))
        cpu_groups = [g for i, g in enumerate(groups) if i not in on_device]
        cpu_params = sum(params for params, _ in cpu_groups)
        block_tensors = max(1, round(model.num_tensors * model.block_params / n))
        hooked = model.n_layer * block_tensors if streamed else sum(tensors for _, tensors in cpu_groups)
        fetches = plan.streamed_fetches(model.n_layer, p.prefetch) if streamed else 0
        fb += (hooked * (hw.grad_hook_overhead + hw.copy_overhead) if hooks else 0) + fetches * hw.fetch_overhead
        d2h = (model.n_layer * model.block_params if streamed else cpu_params) * mb / hw.link_d2h
        fetched = fetches * model.block_params * mb / hw.link_h2d
        passes = stepmodel.ACCUMULATE_BYTES + mb + stepmodel.CLIP_BYTES + stepmodel.ZERO_BYTES + (4 + mb) * (mb != 4)
        update = (len(cpu_groups) * hw.subgroup_overhead + cpu_params / hw.cpu_adam_rate
                  + cpu_params * passes / hw.host_bandwidth)
        summed = n * (stepmodel.ACCUMULATE_BYTES + mb) / hw.host_bandwidth
        drive = 0.0
        if p.params_on == "nvme":
            drive += cpu_params * mb / hw.nvme_write
        if p.optimizer_on == "nvme":
            drive += cpu_params * STATE_BYTES_PER_PARAM * (1 / hw.nvme_read + 1 / hw.nvme_write)
        cpu = update + (accum - 1) * summed
        lanes = {"compute": accum * (fb + outside) + (cpu if hw.shared_host and shared_adds else 0), "cpu": cpu,
                 "d2h": accum * d2h, "h2d": accum * fetched + (0 if streamed else cpu_params * mb / hw.link_h2d),
                 "nvme": drive + (accum * fetches * model.block_params * mb / hw.nvme_read
                                  if p.params_on == "nvme" else 0)}
        if chain and not p.delay:
            more = fb + outside + summed if hw.shared_host else max(fb + outside, d2h, fetched)
            lanes["chain"] = max(fb, d2h, fetched) + max(update, drive) + outside + (accum - 1) * more
        if total:
            return sum(lanes.values())
        if seconds_and_lane:
            return max(lanes.values()), max(lanes, key=lanes.get)
        return max(lanes.values())
    return step_bound


# Task 9.3 --------------------------------------------------------------------------------------

def search_with(*, greedy=False, one_policy=False, no_host=False, strict=False, never_none=False, no_split=False,
                split_costs_nothing=False, overlap_on_shared=False, policies_only=False, per_block=False,
                zeros=False, no_in_flight=False):
    def best_policies(problem):
        def fits(counts, resident):
            device = sum(o.device_bytes * counts.get(o.name, 0) for o in problem.options)
            device += 0 if split_costs_nothing else resident * problem.resident_bytes
            device += 0 if no_in_flight else sum(o.in_flight_bytes for o in problem.options if counts.get(o.name))
            host = sum(o.host_bytes * counts.get(o.name, 0) for o in problem.options)
            if strict:
                return device < problem.device_budget and (no_host or host < problem.host_budget)
            return device <= problem.device_budget * (1 + 1e-9) and \
                (no_host or host <= problem.host_budget * (1 + 1e-9))

        def objective(counts, resident):
            extra = sum(o.extra_s * counts.get(o.name, 0) for o in problem.options)
            cpu, device = (problem.subgroups - resident) * problem.cpu_s, resident * problem.device_s
            if policies_only:
                return extra
            return extra + (cpu + device if problem.shared and not overlap_on_shared else max(cpu, device))

        if greedy:
            counts = {}
            for _ in range(problem.num_blocks):  # each block the cheapest policy with which the blocks so far fit
                fitting = [o for o in problem.options if fits({**counts, o.name: counts.get(o.name, 0) + 1}, 0)]
                if not fitting:
                    return None
                best = min(fitting, key=lambda o: o.extra_s)
                counts[best.name] = counts.get(best.name, 0) + 1
            choices = [counts]
        elif one_policy:
            choices = [{o.name: problem.num_blocks} for o in problem.options]
        else:
            assignments = itertools.product(problem.options, repeat=problem.num_blocks) if per_block else \
                itertools.combinations_with_replacement(problem.options, problem.num_blocks)
            choices = []
            for assignment in assignments:
                counts = {o.name: 0 for o in problem.options} if zeros else {}
                for option in assignment:
                    counts[option.name] = counts.get(option.name, 0) + 1
                choices.append(counts)
        best = None
        for counts in choices:
            for resident in reversed(range(1 if no_split else problem.max_resident + 1)):
                if fits(counts, resident):
                    value = objective(counts, resident)
                    if best is None or value < best.objective:
                        best = Solution(counts, resident, value)
        if best is None and never_none:
            return Solution(choices[0], 0, objective(choices[0], 0))
        return best
    return best_policies


def uses_brute_force(problem):
    return brute_force(problem)


# Task 9.4 --------------------------------------------------------------------------------------


def diagnose_with(*, always=None, fit_noise=False, rate_by_ratio=False, bare=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time."""
    def diagnose(hw, runs, predict):
        counts = [r["subgroups"] for r in runs]
        gaps = [statistics.median(r["measured_s"]) - r["predicted_s"] for r in runs]
        spread = max(max(r["measured_s"]) - min(r["measured_s"]) for r in runs)
        mean_count, mean_gap = statistics.fmean(counts), statistics.fmean(gaps)
        slope = (sum((c - mean_count) * (g - mean_gap) for c, g in zip(counts, gaps, strict=True))
                 / sum((c - mean_count) ** 2 for c in counts))
        per_subgroup = hw.replace(subgroup_overhead=hw.subgroup_overhead + max(slope, 0.0))
        if rate_by_ratio:  # the whole step's ratio put on the Adam rate
            slower = hw.replace(cpu_adam_rate=hw.cpu_adam_rate * runs[0]["predicted_s"]
                                / statistics.median(runs[0]["measured_s"]))
        else:
            slower = hw.replace(cpu_adam_rate=1 / (1 / hw.cpu_adam_rate + mean_gap / runs[0]["params"]))
        fixes = {"per_subgroup_cost": per_subgroup, "cpu_adam_rate": slower, "noise": hw}
        if always:
            return always, fixes[always]
        if slope * (max(counts) - min(counts)) > spread:
            cause = "per_subgroup_cost"
        elif abs(mean_gap) > spread:
            cause = "cpu_adam_rate"
        else:
            return ("noise", per_subgroup) if fit_noise else ("noise", hw)
        return cause if bare else (cause, fixes[cause])
    return diagnose


REFERENCE = {
    "9.1": configure_with(),
    "9.2": bound_with(),
    "9.3": search_with(),
    "9.4": diagnose_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("9.1", configure_with(logits=False), "the logits"),
    ("9.1", configure_with(grads_waiting=False), "gradients on their way"),
    ("9.1", configure_with(backward_block=False), "the block in backward"),
    ("9.1", configure_with(host_tier=False), "host needs"),
    ("9.1", configure_with(micro_batch=1), "90% needed"),
    ("9.1", configure_with(shape=tuple), "expected a dict with the keys"),
    ("9.2", bound_with(chain=False), "the update waits for every gradient"),
    ("9.2", bound_with(hooks=False), "of at least 60% of their step"),
    ("9.2", bound_with(hybrid=False), "above the planner's step"),
    ("9.2", bound_with(total=True), "each piece once"),
    ("9.2", bound_with(compute_only=True), "80% of them needed"),
    ("9.2", bound_with(seconds_and_lane=True), "expected seconds"),
    ("9.3", search_with(greedy=True), "that is the greedy answer"),
    ("9.3", search_with(one_policy=True), "one policy for every block"),
    ("9.3", search_with(no_host=True), "over the host budget"),
    ("9.3", search_with(strict=True), "uses exactly the budget fits"),
    ("9.3", search_with(never_none=True), "Nothing fits this problem: return None"),
    ("9.3", search_with(no_split=True), "no subgroup updated on the device"),
    ("9.3", search_with(split_costs_nothing=True), "resident subgroups x"),
    ("9.3", search_with(overlap_on_shared=True), "the two add up"),
    ("9.3", search_with(policies_only=True), "the policies' time alone"),
    ("9.3", search_with(no_in_flight=True), "in flight: each option in use"),
    ("9.3", search_with(per_block=True), "count blocks per policy instead"),
    ("9.3", uses_brute_force, "called the runtime's `planner.milp.brute_force`"),
    ("9.4", diagnose_with(always="noise"), "noise does not do that"),
    ("9.4", diagnose_with(always="cpu_adam_rate"), "a slower Adam would slow them all alike"),
    ("9.4", diagnose_with(always="per_subgroup_cost"), "a cost per subgroup would grow with the count"),
    ("9.4", diagnose_with(fit_noise=True), "return it as given"),
    ("9.4", diagnose_with(rate_by_ratio=True), "the fix must bring every plan within 3%"),
    ("9.4", diagnose_with(bare=True), "return (cause, profile)"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("9.1", "9.2", "9.3", "9.4"))


def test_the_milp_and_an_answer_with_zero_counts_pass_too():
    assert_passes("9.3", solve)  # the planner's own solver is a right answer
    assert_passes("9.3", search_with(zeros=True))  # counts may list the policies no block takes
