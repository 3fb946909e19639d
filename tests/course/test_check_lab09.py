"""Lab 9 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import itertools
import statistics

from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.planner import search as plan
from minioffload.planner.milp import Solution, brute_force, solve
from minioffload.predict import memory, stepmodel
from minioffload.predict.activation_cost import BlockShape, policy_costs

# Task 9.1 --------------------------------------------------------------------------------------


def fits_with(*, logits_bytes=8, head=True, full=True, one_fewer=False, in_flight=True, grads_on_device=False,
              grads_on_their_way=True,
              offloaded_on_host=True, offloaded_on_device=False, value_bytes=None, nvme_flag=True, streamed=True,
              negative=False, machine=False, nvme_none_is_zero=False):
    """A correct fits(), with switches that turn it into one plausible mistake at a time."""
    def fits(model, hw, limits, *, optimizer_on, params_on, micro_batch, policy, prefetch=0, subgroup_numel=1 << 22):
        precision = limits.precision
        mb = 4 if precision == "fp32" else 2
        nvme = optimizer_on == "nvme" and nvme_flag
        if optimizer_on == "device":
            state = {"device": memory.footprint(precision, "adam", "device").bytes(model.num_params, "device"),
                     "host": 0, "nvme": 0}
        elif params_on == "device" or not streamed:
            state = memory.engine_bytes(plan.tensor_numels(model), precision, optimizer_on="nvme" if nvme else "host",
                                        subgroup_numel=subgroup_numel)
        else:
            state = memory.streamed_bytes(model.num_params, model.n_layer, model.resident_params, params_on,
                                          prefetch, precision, nvme=nvme, subgroup_numel=subgroup_numel)
        state = dict(state)
        if grads_on_device and optimizer_on != "device":
            state["device"] += model.num_params * mb
        block = BlockShape(model.seq_len, micro_batch, model.d_model, model.n_head, value_bytes or mb)
        cost = policy_costs(block, hw)[policy]
        offloaded = cost.link_bytes if policy.startswith("offload") else 0
        held = cost.device_bytes + (offloaded if offloaded_on_device else 0)
        blocks = model.n_layer - 1 if one_fewer else model.n_layer
        waiting = 0
        if grads_on_their_way and optimizer_on != "device" and params_on == "device":
            numels = plan.tensor_numels(model)
            waiting = (max(plan.pack_sizes(numels, subgroup_numel)) + max(numels)) * mb
        need = {"device": state["device"] + blocks * held + full * block.saved_bytes() + in_flight * offloaded + waiting
                + head * 2 * micro_batch * model.seq_len * model.d_model * (value_bytes or mb)
                + logits_bytes * micro_batch * model.seq_len * model.vocab,
                "host": state["host"] + model.n_layer * offloaded * (offloaded_on_host and not offloaded_on_device),
                "nvme": state["nvme"]}
        capacity = limits.capacity(hw)
        if machine:
            capacity = {"device": hw.device_memory, "host": hw.host_memory, "nvme": capacity["nvme"]}
        if nvme_none_is_zero:
            capacity = {t: 0 if v is None else v for t, v in capacity.items()}
        short = {t: 0 if capacity[t] is None else need[t] - capacity[t] if negative else max(0, need[t] - capacity[t])
                 for t in need}
        return need, short
    return fits


# Task 9.2 --------------------------------------------------------------------------------------

def tokens_with(*, accumulate=True, repeat=False, policies_once=False, no_policies=False, no_overhead=False,
                first_overhead=True, max_on_shared=False, sum_on_gpu=False, hooks=True, fetches=True, fetch_costs=True,
                clip=True, whole_batch=False, seconds=False, one_micro_batch=False):
    def tokens_per_s(p, hw, limits):
        model, accum = p.model, p.grad_accum
        mb = 4 if p.precision == "fp32" else 2
        tokens = p.micro_batch * model.seq_len * (accum if whole_batch else 1)
        work = stepmodel.Workload(model.num_params, tokens, p.precision, model.num_tensors,
                                  num_layers=model.n_layer, resident_params=model.resident_params)
        config = p.step_config(limits.mfu).replace(max_grad_norm=1.0 if clip else None)
        one = stepmodel.predict(work, hw, config).step_s
        overhead = 0 if no_overhead else model.n_layer * limits.block_overhead_s
        costs = policy_costs(BlockShape(model.seq_len, p.micro_batch, model.d_model, model.n_head, mb), hw,
                             limits.mfu)
        policies = 0 if no_policies else sum(costs[a].extra_s for a in p.activations) * (1 if policies_once else accum)
        compute = 6 * model.num_params * p.micro_batch * model.seq_len / (hw.peak_flops(p.precision) * limits.mfu)
        compute += overhead
        if p.optimizer_on == "device":
            more = compute
        else:
            compute += model.num_tensors * (hw.grad_hook_overhead + hw.copy_overhead) * hooks
            summed = model.num_params * (stepmodel.ACCUMULATE_BYTES + mb) / hw.host_bandwidth
            moves = [model.num_params * mb / hw.link_d2h, summed]
            if p.params_on != "device" and fetches:
                count, block = plan.streamed_fetches(model.n_layer, p.prefetch), model.block_params * mb
                tensors = max(1, round(model.num_tensors * model.block_params / model.num_params))
                compute += count * hw.fetch_overhead * fetch_costs
                moves.append(count * (tensors * hw.link_latency * fetch_costs + block / hw.link_h2d))
                if p.params_on == "nvme":
                    moves.append(count * (hw.nvme_read_overhead * fetch_costs + block / hw.nvme_read))
            shared = (hw.shared_host and not max_on_shared) or sum_on_gpu
            more = compute + summed if shared else max(compute, *moves)
        first = overhead if first_overhead else 0
        if repeat:
            step = accum * (one + first) + policies
        elif whole_batch:
            step = one + first + policies
        else:
            step = one + first + policies + (accum - 1) * more * accumulate
        if seconds:
            return step
        return p.micro_batch * (1 if one_micro_batch else accum) * model.seq_len / step
    return tokens_per_s


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
    "9.1": fits_with(),
    "9.2": tokens_with(),
    "9.3": search_with(),
    "9.4": diagnose_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("9.1", fits_with(logits_bytes=0), "no logits"),
    ("9.1", fits_with(logits_bytes=4), "the logits at the model's dtype"),
    ("9.1", fits_with(head=False), "no head inputs"),
    ("9.1", fits_with(full=False), "no block in backward"),
    ("9.1", fits_with(one_fewer=True), "memory.activation_bytes counts"),
    ("9.1", fits_with(in_flight=False), "no set in flight"),
    ("9.1", fits_with(grads_on_device=True), "gradients counted on the device"),
    ("9.1", fits_with(grads_on_their_way=False), "no gradients on their way"),
    ("9.1", fits_with(offloaded_on_host=False), "left out of host memory"),
    ("9.1", fits_with(offloaded_on_device=True), "offloaded activations counted on the device"),
    ("9.1", fits_with(value_bytes=2), "activations counted at 2 bytes per value"),
    ("9.1", fits_with(nvme_flag=False), "pass optimizer_on='nvme' to engine_bytes, nvme=True to streamed_bytes"),
    ("9.1", fits_with(streamed=False), "streamed weights counted as resident"),
    ("9.1", fits_with(negative=True), "never a negative number"),
    ("9.1", fits_with(machine=True), "limits.capacity(hw)"),
    ("9.1", fits_with(nvme_none_is_zero=True), "None means unbounded"),
    ("9.2", tokens_with(accumulate=False), "the other micro-batches left out"),
    ("9.2", tokens_with(repeat=True), "the whole step repeated per micro-batch"),
    ("9.2", tokens_with(policies_once=True), "policies' time counted once"),
    ("9.2", tokens_with(no_policies=True), "policies' time left out"),
    ("9.2", tokens_with(no_overhead=True), "per-block overhead left out"),
    ("9.2", tokens_with(first_overhead=False), "the first one's included"),
    ("9.2", tokens_with(max_on_shared=True), "on a shared host"),
    ("9.2", tokens_with(sum_on_gpu=True), "compute and moves added up on a GPU"),
    ("9.2", tokens_with(hooks=False), "the hooks' copies left out"),
    ("9.2", tokens_with(fetches=False), "the streamed blocks' fetches or their fixed costs left out"),
    ("9.2", tokens_with(fetch_costs=False), "the streamed blocks' fetches or their fixed costs left out"),
    ("9.2", tokens_with(clip=False), "no clipping in the prediction"),
    ("9.2", tokens_with(whole_batch=True), "the whole batch predicted as one micro-batch"),
    ("9.2", tokens_with(seconds=True), "that is the step's seconds"),
    ("9.2", tokens_with(one_micro_batch=True), "the tokens of one micro-batch"),
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
