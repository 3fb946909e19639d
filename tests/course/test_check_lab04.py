"""Lab 4 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import math

import pytest
import torch
from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.course import check
from minioffload.course.check import lab04_clip
from minioffload.kernels import adam

# Task 4.1 --------------------------------------------------------------------------------------

def make_grad_hook(dev, stream, staging, pending, *, adopt=True, wait=True, record=True, release=True,
                   copy_stream="given", event_first=False, keep=None, sync=False):
    """The reference answer, with switches that turn it into one plausible mistake at a time."""
    def hook(param):
        grad = param.grad
        if wait:
            dev.stream_waits_for_compute(stream)
        if adopt:
            dev.adopt(grad, "grad")
        done = dev.event()
        if record and event_first:
            done.record(stream)
        on = {"given": stream, "default": None, "other": other}[copy_stream]
        dev.copy(staging[param], grad, on)
        if record and not event_first:
            done.record(stream)
        if sync:
            done.synchronize()
        pending.append((param, done if record else None))
        if keep is not None:
            keep.append(grad)
        if release:
            param.grad = None

    other = dev.stream("another") if copy_stream == "other" else None
    return hook


def hook_with(**mistake):
    def fn(dev, stream, staging, pending):
        return make_grad_hook(dev, stream, staging, pending, **mistake)
    return fn


def event_on_default_stream(dev, stream, staging, pending):
    def hook(param):
        grad = param.grad
        dev.stream_waits_for_compute(stream)
        dev.adopt(grad, "grad")
        dev.copy(staging[param], grad, stream)
        done = dev.event()
        done.record(dev.default_stream)  # fires at once: the copy is still in flight
        pending.append((param, done))
        param.grad = None
    return hook


def shared_event(dev, stream, staging, pending):
    done = dev.event()

    def hook(param):
        grad = param.grad
        dev.stream_waits_for_compute(stream)
        dev.adopt(grad, "grad")
        dev.copy(staging[param], grad, stream)
        done.record(stream)
        pending.append((param, done))
        param.grad = None
    return hook


# Task 4.2 --------------------------------------------------------------------------------------

def update_and_upload(dev, h2d, subgroups, step, lr, weight_decay, *, upload_first=False, all_at_end=False,
                      record=True, event_stream=None, offset_shift=0):
    def update(sub):
        adam.adam_fused(sub["master"], sub["grad"], sub["exp_avg"], sub["exp_avg_sq"], step=step, lr=lr,
                        weight_decay=weight_decay)

    def upload(sub):
        for param, offset in sub["params"]:
            start = max(0, offset - offset_shift)
            dev.copy(param.data, sub["master"][start: start + param.numel()].view(param.shape), h2d)

    for sub in subgroups:
        if upload_first:
            upload(sub)
        update(sub)
        if not upload_first and not all_at_end:
            upload(sub)
    if all_at_end:
        for sub in subgroups:
            upload(sub)
    if not record:
        return None
    done = dev.event()
    done.record(event_stream(dev) if event_stream else h2d)
    return done


def update_with(**mistake):
    def fn(dev, h2d, subgroups, step, lr, weight_decay):
        return update_and_upload(dev, h2d, subgroups, step, lr, weight_decay, **mistake)
    return fn


def update_synchronizing(dev, h2d, subgroups, step, lr, weight_decay):
    for sub in subgroups:
        update_and_upload(dev, h2d, [sub], step, lr, weight_decay)
        dev.synchronize()  # waits for every upload: the CPU idles while the link works
    done = dev.event()
    done.record(h2d)
    return done


def update_fixed_step(dev, h2d, subgroups, step, lr, weight_decay):
    return update_and_upload(dev, h2d, subgroups, 1, lr, weight_decay)


# Other orders of calls that satisfy the same properties: the lab states what must hold, not a sequence.

def hook_in_another_order(dev, stream, staging, pending):
    """Counts the gradient first, makes the event up front, keeps the memory alive for the copy stream, drops
    .grad before recording, and appends to pending last."""
    def hook(param):
        grad = dev.adopt(param.grad, "grad")
        done = dev.event()
        dev.stream_waits_for_compute(stream)
        dev.copy(staging[param], grad, stream, name="grad d2h")
        dev.keep_alive(grad, stream)
        param.grad = None
        del grad
        done.record(stream)
        pending.append((param, done))
    return hook


def upload_one_behind(dev, h2d, subgroups, step, lr, weight_decay):
    """Uploads subgroup k - 1 after updating subgroup k (and the last at the end), one event per subgroup's
    uploads, and returns the last: still each subgroup after its own update, still overlapped."""
    def upload(sub):
        for param, offset in sub["params"]:
            dev.copy(param.data, sub["master"].narrow(0, offset, param.numel()).view_as(param), h2d)
        done = dev.event()
        done.record(h2d)
        return done

    events, previous = [], None
    for sub in subgroups:
        adam.adam_fused(sub["master"], sub["grad"], sub["exp_avg"], sub["exp_avg_sq"], step=step, lr=lr,
                        weight_decay=weight_decay)
        if previous is not None:
            events.append(upload(previous))
        previous = sub
    events.append(upload(previous))
    return events[-1]


# Task 4.3 --------------------------------------------------------------------------------------

def clip_coefficient(partial_sums_of_squares, max_norm):
    total_norm = math.sqrt(sum(partial_sums_of_squares))
    return total_norm, min(1.0, max_norm / (total_norm + 1e-6))


def link_bytes_per_step(num_params, model_dtype):
    return 2 * num_params * torch.empty(0, dtype=model_dtype).element_size()


# Task 4.5 --------------------------------------------------------------------------------------

def diagnose_with(*, order=None, drop_loop_clip_only=False, delay_one_later=False, fewer_micro_batches=False,
                  returns_list=False):
    """A correct diagnosis, with switches that turn it into one plausible mistake at a time. `order`: read the
    settings only, and blame the first odd one in this order, whether or not it changed anything."""
    def diagnose_drift(recipe, run):
        s, steps = run["settings"], len(run["losses"])
        pairs = zip(run["losses"], run["torch_losses"], strict=True)
        parted = next(i for i, (a, b) in enumerate(pairs) if abs(a - b) > 1e-5)
        odd = {"stale": s["delay_updates_after"] is not None,
               "accumulation": s["zero_grad"] == "each micro-batch",
               "clipping": s["max_grad_norm"] != recipe["max_norm"]}
        if order:
            cause = next(c for c in order if odd[c])
        elif odd["stale"] and s["delay_updates_after"] + 1 == parted < steps:
            cause = "stale"
        elif odd["accumulation"] and recipe["micro_batches"] > 1:
            cause = "accumulation"
        else:
            cause = "clipping"
        if cause == "stale":
            fix = {"delay_updates_after": s["delay_updates_after"] + 1 if delay_one_later else None}
        elif cause == "accumulation":
            fix = {"zero_grad": "each step"}
            if fewer_micro_batches:
                fix["micro_batches"] = 1
        else:
            fix = {"clip_in_loop": False} if drop_loop_clip_only else {"clip_in_loop": False,
                                                                        "max_grad_norm": recipe["max_norm"]}
        return [cause, fix] if returns_list else (cause, fix)
    return diagnose_drift


def diagnose_keeping_the_delay(recipe, run):
    """Another right answer: a delayed update that begins with the last step sends its weights at flush() in time."""
    cause, fix = diagnose_with()(recipe, run)
    if cause == "stale":
        fix = {"delay_updates_after": recipe["steps"] - 1}
    return cause, fix


REFERENCE = {
    "4.1": make_grad_hook,
    "4.2": update_and_upload,
    "4.3": clip_coefficient,
    "4.4": link_bytes_per_step,
    "4.5": diagnose_with(),
}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("4.1", hook_with(record=False), "where the event should be"),
    ("4.1", hook_with(adopt=False), "must count in dev.ledger"),
    ("4.1", hook_with(release=False), "still hold .grad"),
    ("4.1", hook_with(copy_stream="default"), "the default stream"),
    ("4.1", hook_with(copy_stream="other"), "stream 'another'"),
    ("4.1", hook_with(wait=False), "not ordered after the compute that wrote the gradient"),
    ("4.1", hook_with(event_first=True), "before the copy"),
    ("4.1", hook_with(sync=True), "synchronize inside the hook"),
    ("4.1", hook_with(keep=[]), "still references a gradient"),
    ("4.1", event_on_default_stream, "fires without waiting for the copy"),
    ("4.1", shared_event, "its own event"),
    ("4.1", lambda dev, stream, staging, pending: None, "return the function"),
    ("4.2", update_with(upload_first=True), "enqueued before subgroup 0's update had run"),
    ("4.2", update_with(all_at_end=True), "every upload was enqueued after all 3 subgroups"),
    ("4.2", update_with(record=False), "returned None"),
    ("4.2", update_with(event_stream=lambda dev: dev.default_stream), "uploads had finished"),
    ("4.2", update_with(offset_shift=16), "differs from torch AdamW"),
    ("4.2", update_fixed_step, "step 2"),
    ("4.2", update_synchronizing, "a synchronize in the loop"),
    ("4.3", lambda partial, max_norm: (sum(partial), min(1.0, max_norm / (sum(partial) + 1e-6))),
     "take its square root"),
    ("4.3", lambda partial, max_norm: (math.sqrt(sum(partial)), min(1.0, max_norm / math.sqrt(sum(partial)))),
     "+ 1e-6"),
    ("4.3", lambda partial, max_norm: (math.sqrt(sum(partial)), max_norm / (math.sqrt(sum(partial)) + 1e-6)),
     "min(1, ...)"),
    ("4.3", lambda partial, max_norm: (sum(map(math.sqrt, partial)), 1.0), "add their squares"),
    ("4.4", lambda num_params, dtype: num_params * torch.empty(0, dtype=dtype).element_size(), "one direction"),
    ("4.4", lambda num_params, dtype: num_params * (4 + torch.empty(0, dtype=dtype).element_size()),
     "fp32 master copy never leaves"),
    ("4.5", diagnose_with(order=("clipping", "stale", "accumulation")), "it scaled no gradient"),
    ("4.5", diagnose_with(order=("accumulation", "stale", "clipping")), "there is nothing to accumulate"),
    ("4.5", diagnose_with(order=("stale", "accumulation", "clipping")), "no forward ran on weights it left behind"),
    ("4.5", diagnose_with(drop_loop_clip_only=True), "the run still parts from torch's"),
    ("4.5", diagnose_with(delay_one_later=True), "the run still parts from torch's"),
    ("4.5", diagnose_with(fewer_micro_batches=True), "a fix may change only"),
    ("4.5", diagnose_with(returns_list=True), "return (cause, fix)"),
]


test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, ("4.1", "4.2", "4.5"))


@pytest.mark.parametrize("task_id, fn", [("4.1", hook_in_another_order), ("4.2", upload_one_behind),
                                         ("4.5", diagnose_keeping_the_delay)],
                         ids=["hook-in-another-order", "upload-one-behind", "diagnose-keeping-the-delay"])
def test_another_order_of_calls_that_satisfies_the_properties_passes(task_id, fn):
    assert_passes(task_id, fn)


def test_a_forgotten_1e6_divides_by_zero_on_an_all_zero_gradient():
    verdict = check.grade("4.3", lambda partial, max_norm: (math.sqrt(sum(partial)),
                                                             min(1.0, max_norm / math.sqrt(sum(partial)))))
    assert verdict.status == "FAIL" and ("+ 1e-6" in verdict.detail or "divided by zero" in verdict.detail)


def test_a_hook_that_is_a_stub_is_todo():
    def make(dev, stream, staging, pending):
        def hook(param):
            raise NotImplementedError("Task 4.1")
        return hook

    assert check.grade("4.1", make).status == "TODO"


def test_the_measured_coefficient_is_torchs_min_of_one_and_the_ratio():
    for norm, max_norm in ((10.0, 1.0), (0.5, 1.0), (0.0, 1.0), (0.0, 1e-7), (3e-7, 1e-6)):
        assert math.isclose(lab04_clip.torch_coefficient(norm, max_norm), min(1.0, max_norm / (norm + 1e-6)),
                            rel_tol=1e-12)


def test_the_engine_moves_two_copies_of_the_model_dtype_per_parameter():
    assert {dtype: lab04_clip.engine_link_bytes(dtype) for dtype in lab04_clip.LINK_DTYPES} == {
        torch.float32: 8, torch.bfloat16: 4, torch.float16: 4}
