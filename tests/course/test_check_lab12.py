"""Lab 12 verdicts: right answers pass, plausible mistakes fail with a reason that names them, stubs say TODO; the
graders' counts are the runtime's (a real run's drive bytes), and each diagnosis case has one cause and one fix."""

import collections
import re
import tempfile
from pathlib import Path

import nbformat
import pytest
import torch
from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

import minioffload.course.check.lab12  # noqa: F401  (registers Tasks 12.1 and 12.2)
from minioffload.course import check
from minioffload.course.check import lab12, lab12_diagnose
from minioffload.predict import memory
from minioffload.predict.shapes import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "exercises" / "solutions" / "lab12_host_budget.ipynb"

# Task 12.1 -------------------------------------------------------------------------------------


def drive_traffic(model, placement, micro_batches, prefetch=1, *, refuse=True, per_step_weights=False,
                  keep_none=False, resident_streamed=False, all_written=False, state_bytes=12, previous=False,
                  grads_once=False, grad_bytes=4, no_update_read=False, host_moves=False, message=None):
    """A right answer, with switches that turn it into one plausible mistake at a time."""
    if refuse and placement["grads"] == "nvme" and placement["state"] == "host":
        raise ValueError(message or "gradients on NVMe need the state on 'nvme' too")
    m, layers, block = micro_batches, model.n_layer, model.block_params
    fetches = 2 * layers - (0 if keep_none else min(layers, (prefetch + 1) // 2))
    per_block = model.num_params / layers if resident_streamed else block
    weights = (int((1 if per_step_weights else m) * fetches * per_block) * 2,
               (model.num_params if all_written else layers * block) * 2)
    state = (state_bytes * model.num_params, (2 if previous else 1) * 12 * model.num_params)
    sums = grad_bytes * (1 if grads_once else m) * model.num_params
    grads = (sums - (4 * model.num_params if no_update_read else 0), sums)
    moved = {"weights": weights, "state": state, "grads": grads}
    return {k: v if host_moves or placement[k] == "nvme" else (0, 0) for k, v in moved.items()}


def traffic_with(**mistake):
    def fn(model, placement, micro_batches, prefetch=1):
        return drive_traffic(model, placement, micro_batches, prefetch, **mistake)
    return fn


def traffic_changing_placement(model, placement, micro_batches, prefetch=1):
    got = drive_traffic(model, placement, micro_batches, prefetch)
    placement["grads"] = placement["grads"]
    placement.pop("weights")
    return got


def traffic_of_floats(model, placement, micro_batches, prefetch=1):
    return {k: (float(r), float(w)) for k, (r, w) in drive_traffic(model, placement, micro_batches, prefetch).items()}


def traffic_by_planner(model, placement, micro_batches, prefetch=1):
    """Calls the runtime's fetch count, which the task asks for."""
    from minioffload.planner import search

    got = drive_traffic(model, placement, micro_batches, prefetch)
    if placement["weights"] == "nvme":
        got["weights"] = (micro_batches * search.streamed_fetches(model.n_layer, prefetch) * model.block_params * 2,
                          got["weights"][1])
    return got


# Task 12.2 -------------------------------------------------------------------------------------

ORDER = [dict(zip(("weights", "state", "grads"), t, strict=True)) for t in
         [(w, s, g) for w in ("host", "nvme") for s in ("host", "nvme") for g in ("host", "nvme")]]


def host_of(model, placement, per_param_only=False):
    if per_param_only:
        return model.num_params * (2 * (placement["weights"] == "host") + 12 * (placement["state"] == "host")
                                   + 6 * (placement["grads"] == "host"))
    return memory.streamed_bytes(model.num_params, model.n_layer, resident_params=model.resident_params,
                                 params_on=placement["weights"], nvme=placement["state"] == "nvme",
                                 grads_on=placement["grads"])["host"]


def choose_placement(model, budget, hw, micro_batches, *, strict=False, by="drive", seconds="sum",
                     per_param_only=False, allow_refused=False, tie="host", none=True):
    rows = []
    for n, p in enumerate(ORDER):
        if not allow_refused and p["grads"] == "nvme" and p["state"] == "host":
            continue
        host = host_of(model, p, per_param_only or (p["grads"] == "nvme" and p["state"] == "host"))
        if (host >= budget) if strict else (host > budget):
            continue
        moved = drive_traffic(model, p, micro_batches, refuse=False).values()
        reads, writes = sum(r for r, _ in moved) / hw.nvme_read, sum(w for _, w in moved) / hw.nvme_write
        drive = reads + writes if seconds == "sum" else max(reads, writes)
        key = {"drive": (drive, host if tie == "host" else -host, n), "host": (host, drive, n)}[by]
        rows.append((key, p))
    if not rows:
        return None if none else ORDER[-1]
    return min(rows, key=lambda r: r[0])[1]


def choose_with(**mistake):
    def fn(model, budget, hw, micro_batches):
        return choose_placement(model, budget, hw, micro_batches, **mistake)
    return fn


# Task 12.3 -------------------------------------------------------------------------------------


def totals(run):
    out = collections.Counter()
    for owner, nbytes in run["pinned"]:
        out[owner] += nbytes
    return out


def largest_numel(run, sets=66, blocks=4):
    model, numel = run["model"], 1
    while blocks * 2 * model.block_params + sets * min(2 * numel, model.num_params) <= run["budget"]:
        numel *= 2
        if numel >= model.num_params:
            break
    return numel


CAUSE_OF_OWNER = {"gradient sum": "grads_on_host", "gradient staging": "grads_on_host", "weights home": "home_on_host",
                  "working set": "subgroups_too_large", "gradient set": "subgroups_too_large",
                  "bounce buffer": "subgroups_too_large", "write buffer": "subgroups_too_large"}
FIX = {"grads_on_host": {"grads_on": "nvme"}, "home_on_host": {"home": "nvme"}}


def diagnose_refusal(run, *, rule="owners", numel="largest", fix_with=None):
    if rule == "owners":
        cause = CAUSE_OF_OWNER[max(totals(run).items(), key=lambda kv: kv[1])[0]]
    elif rule == "refused":
        cause = CAUSE_OF_OWNER[run["refused"][0]]
    else:  # the largest single buffer
        cause = CAUSE_OF_OWNER[max(run["pinned"], key=lambda b: b[1])[0]]
    if fix_with is not None:
        return cause, fix_with(run)
    if cause != "subgroups_too_large":
        return cause, dict(FIX[cause])
    best = largest_numel(run)
    return cause, {"subgroup_numel": {"largest": best, "half": best // 2, "per_param": largest_numel(run, sets=48)
                                      }[numel]}


def diagnose_with(**mistake):
    def fn(run):
        return diagnose_refusal(run, **mistake)
    return fn


def diagnose_shrinking_subgroups(run, always=False):
    """Names the cause rightly, then shrinks the subgroups instead of moving what filled the budget (`always`, or
    where its estimate says that would fit: the buffers not sized by a subgroup, the write buffers to come, and the
    sets of a smaller subgroup)."""
    cause, fix = diagnose_refusal(run)
    if cause == "subgroups_too_large":
        return cause, fix
    sets = ("working set", "gradient set")
    kept = [n for owner, n in [*run["pinned"], run["refused"]] if owner not in sets]
    bounce = [n for owner, n in run["pinned"] if owner == "bounce buffer"]
    estimate = sum(kept) + sum(bounce) + 66 * (1 << 20)
    return cause, {"subgroup_numel": 1 << 20} if always or estimate <= run["budget"] else fix


REFERENCE = {"12.1": drive_traffic, "12.2": choose_placement, "12.3": diagnose_refusal}
BUILT_ON_THE_RUNTIME = ()

WRONG = [
    ("12.1", traffic_with(per_step_weights=True), "that is one micro-batch's fetches"),
    ("12.1", traffic_with(keep_none=True), "the streamer keeps the last (prefetch + 1) // 2 blocks"),
    ("12.1", traffic_with(resident_streamed=True), "the resident parameters (embeddings, the final norm) stay"),
    ("12.1", traffic_with(all_written=True), "only the blocks' weights go home"),
    ("12.1", traffic_with(state_bytes=16), "the gradient read beside the state belongs to the grads' count"),
    ("12.1", traffic_with(previous=True), "the previous version kept on the drive is space, not traffic"),
    ("12.1", traffic_with(grads_once=True), "that is one micro-batch's: each micro-batch writes"),
    ("12.1", traffic_with(grad_bytes=2), "fp32 sums, 4 bytes a parameter"),
    ("12.1", traffic_with(no_update_read=True), "the update reads each subgroup's final gradient too"),
    ("12.1", traffic_with(host_moves=True), "live in host memory here: they move nothing"),
    ("12.1", traffic_with(refuse=False), "raise a ValueError that says to put the state on 'nvme'"),
    ("12.1", traffic_with(message="that placement is not supported"), "which does not say the fix"),
    ("12.1", traffic_changing_placement, "changed the placement it was given"),
    ("12.1", traffic_of_floats, "bytes as ints"),
    ("12.1", traffic_by_planner, "called the runtime's `planner.search.streamed_fetches`"),
    ("12.2", choose_with(strict=True), "a placement whose bytes equal the budget fits"),
    ("12.2", choose_with(by="host"), "also fits and takes"),
    ("12.2", choose_with(seconds="max"), "the bytes read over nvme_read plus the bytes written over nvme_write"),
    ("12.2", choose_with(per_param_only=True), "working sets and buffers included"),
    ("12.2", choose_with(allow_refused=True), "which the runtime refuses"),
    ("12.2", choose_with(none=False), "no placement fits (count the calculator's host bytes"),
    ("12.3", diagnose_with(rule="refused"), "case 4: not 'subgroups_too_large'"),
    ("12.3", diagnose_with(rule="largest"), "case 1: not 'subgroups_too_large'"),
    ("12.3", diagnose_with(numel="half"), "the largest power of two that fits"),
    ("12.3", diagnose_with(numel="per_param"), "the run still pins"),
    ("12.3", diagnose_shrinking_subgroups, "case 5 (home_on_host, rightly): with {'subgroup_numel': 1048576} the run "
     "fits"),
    ("12.3", lambda run: diagnose_shrinking_subgroups(run, always=True), "case 1 (grads_on_host, rightly): with "
     "{'subgroup_numel': 1048576} the run still pins"),
    ("12.3", diagnose_with(fix_with=lambda run: "grads_on='nvme'"), "return one setting as a dict"),
]

test_reference_passes = reference_passes(REFERENCE, BUILT_ON_THE_RUNTIME)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG, BUILT_ON_THE_RUNTIME)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, REFERENCE)


def test_a_tie_goes_to_the_fewer_host_bytes_then_the_order():
    """No grid case ties on drive time; the rule is still the one the lab states (fewer host bytes, then order)."""
    model, hw = ModelSpec.of_params(13e9), lab12.profiles.preset("h200")
    budget = 10 ** 15
    assert lab12.best(model, budget, hw, 1) == {"weights": "host", "state": "host", "grads": "host"}
    assert choose_placement(model, budget, hw, 1, tie="more host") == lab12.best(model, budget, hw, 1)


def test_every_budget_grid_has_a_none_and_a_boundary():
    model = ModelSpec.of_params(13e9)
    budgets = lab12._budgets(model)
    sizes = {lab12.host_bytes(model, p) for p in lab12.placements() if lab12.allowed(p)}
    assert min(budgets) < min(sizes) and sizes <= set(budgets) and max(budgets) > max(sizes)


@pytest.fixture(scope="module")
def measured_step():
    """One real step of the chapter's off-memory setup on the sim (after a first, untimed one): the drive's bytes per
    kind and direction from the trace's spans."""
    from minioffload.devices import device
    from minioffload.engine.optimizer import OffloadAdam
    from minioffload.model.gpt import GPT, GPTConfig
    from minioffload.model.streaming import ParamStreamer
    from minioffload.nvme.swapper import Swapper

    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.0)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    counts = collections.Counter()
    with tempfile.TemporaryDirectory() as folder:
        swapper = Swapper(Path(folder))
        with device("sim") as dev:
            swapper.trace = dev.trace
            streamer = ParamStreamer(net, dev, prefetch=1, home="nvme", swapper=swapper)
            opt = OffloadAdam(net.parameters(), dev, lr=1e-3, subgroup_numel=1 << 15, max_grad_norm=1.0,
                              swapper=swapper, streamer=streamer, grads_on="nvme", grad_buffers=3)
            for _ in range(2):
                swapper.drain()  # the first step's requests all done, the second step's first block among them
                begun = dev.trace.now()
                for _ in range(2):
                    x, y = (torch.randint(0, 65, (2, 32), generator=g) for _ in range(2))
                    (net(dev.to_device(x), dev.to_device(y))[1] / 2).backward()
                opt.step()
                opt.zero_grad()
                dev.synchronize()
                opt.nvme.drain()
                swapper.drain()  # the next step's first block, fetched during this update, is this step's
            ended, trace = dev.trace.now(), dev.trace
            opt.close()
        swapper.close()  # every request done, so every span recorded
    # the second step's requests, by when each started: its first block was fetched during the first step's update,
    # and it fetches the next step's first block during its own, so its window holds one step's fetches
    for span in trace.spans:
        if span.lane in ("nvme_read", "nvme_write") and begun <= span.start < ended:
            kind = ("weights" if span.name.startswith("weights/") else
                    "grads" if span.name.endswith("/grad") else "state")
            counts[kind, span.lane == "nvme_write"] += span.nbytes
    return counts


def test_the_graders_counts_are_what_the_runtime_moves(measured_step):
    model = ModelSpec(4, 64, 4, 65, 32)
    want = lab12.expected(model, {"weights": "nvme", "state": "nvme", "grads": "nvme"}, 2)
    got = {kind: (measured_step[kind, False], measured_step[kind, True]) for kind in lab12.KINDS}
    assert got == want


def test_each_diagnosis_case_has_one_cause_and_one_fix():
    fixes = {"grads_on_host": {"grads_on": "nvme"}, "home_on_host": {"home": "nvme"}}
    for cause, setup in (*lab12_diagnose.CASES, lab12_diagnose.EXAMPLE):
        assert not lab12_diagnose.fits(setup)
        seen = lab12_diagnose.evidence(setup)
        held = sum(n for _, n in seen["pinned"])
        assert held <= setup.budget < held + seen["refused"][1]
        assert lab12_diagnose.pinned_bytes(setup) == sum(n for _, n in lab12_diagnose.allocations(setup))
        for other, fix in fixes.items():
            assert lab12_diagnose.fits(setup.with_fix(fix)) == (other == cause), (cause, other)
        if cause == "subgroups_too_large":
            assert lab12_diagnose.largest_subgroup_that_fits(setup) is not None


def test_the_cases_do_not_all_point_the_same_way():
    """The last buffer asked for and the largest single buffer each point at the wrong cause somewhere."""
    refused = [CAUSE_OF_OWNER[lab12_diagnose.evidence(s)["refused"][0]] != c for c, s in lab12_diagnose.CASES]
    largest = [CAUSE_OF_OWNER[max(lab12_diagnose.evidence(s)["pinned"], key=lambda b: b[1])[0]] != c
               for c, s in lab12_diagnose.CASES]
    assert any(refused) and any(largest)


@pytest.mark.parametrize("task_id", sorted(REFERENCE))
def test_the_solution_notebook_answers_pass(task_id):
    """The notebook's own answers, run outside Jupyter: each passes its grader."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    namespace: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and ("# BEGIN SOLUTION" in cell.source or cell.source.startswith("import")):
            exec(compile(cell.source, "<lab12 solution>", "exec"), namespace)
    called = {re.search(r'check\.task\("([\d.]+)", (\w+)\)', c.source).groups()
              for c in nb.cells if c.cell_type == "code" and 'check.task("' in c.source}
    assert_passes(task_id, namespace[dict(called)[task_id]])


def test_a_verdict_is_one_line():
    for task_id, fn in REFERENCE.items():
        assert "\n" not in str(check.grade(task_id, fn))


def test_the_diagnosis_buffers_add_up_to_what_the_calculator_counts():
    # the evidence's buffers are the runtime's: their sum is memory.streamed_bytes' host bytes, wrong setting or fixed
    for cause, setup in (*lab12_diagnose.CASES, lab12_diagnose.EXAMPLE):
        for run in (setup, setup.with_fix({"grads_on": "nvme", "home": "nvme"})):
            m = run.model
            counted = memory.streamed_bytes(m.num_params, m.n_layer, resident_params=m.resident_params,
                                            params_on=run.home, nvme=True, subgroup_numel=run.subgroup_numel,
                                            grads_on=run.grads_on, grad_buffers=lab12_diagnose.SETS)["host"]
            assert lab12_diagnose.pinned_bytes(run) == counted, (cause, run)
