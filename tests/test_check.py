"""Lab verdicts: right answers pass, wrong ones fail with a reason, stubs say TODO."""

import math

import pytest

from minioffload import check, memory


def stub(*args):
    raise NotImplementedError("Task")


REFERENCE = {
    "1.1": lambda precision, optimizer: memory.footprint(precision, optimizer).per_param(),
    "1.2": lambda s, b, h, a, ckpt: memory.activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt),
    "1.3": lambda gpu, precision, placement: math.floor(
        memory.max_params_that_fit(gpu, memory.footprint(precision, "adam", placement))),
    "1.4": lambda n, device, host: memory.first_placement_that_fits(n, device, host_bytes=host),
}
WRONG = {  # plausible mistakes a learner makes
    "1.1": lambda precision, optimizer: 16,  # the famous number for every setup
    "1.2": lambda s, b, h, a, ckpt: 34 * s * b * h,  # forgot the attention scores
    "1.3": lambda gpu, precision, placement: int(gpu // 16),  # ignored the placement
    "1.4": lambda n, device, host: "optimizer_cpu" if 16 * n > device else "device",  # ignored host memory
}


@pytest.mark.parametrize("task_id", sorted(REFERENCE))
def test_reference_passes(task_id):
    verdict = check.grade(task_id, REFERENCE[task_id])
    assert verdict.passed, str(verdict)
    assert str(verdict).startswith(f"PASS Task {task_id}: ")


@pytest.mark.parametrize("task_id", sorted(WRONG))
def test_plausible_mistake_fails_with_a_reason(task_id):
    verdict = check.grade(task_id, WRONG[task_id])
    assert verdict.status == "FAIL" and "expected" in verdict.detail, str(verdict)


@pytest.mark.parametrize("task_id", sorted(REFERENCE))
def test_stub_is_todo(task_id):
    assert check.grade(task_id, stub).status == "TODO"


def test_a_crash_is_a_verdict_not_a_traceback():
    verdict = check.grade("1.1", lambda precision, optimizer: {}["missing"])
    assert verdict.status == "FAIL" and "KeyError" in verdict.detail
    assert check.grade("1.1", 16).status == "FAIL"


def test_unknown_task_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="known tasks: 1.1, 1.2"):
        check.grade("9.9", stub)


def test_task_and_expect_print_exactly_one_line(capsys):
    check.task("1.1", REFERENCE["1.1"])
    check.expect("two is even", 2 % 2 == 0, "2 % 2 = 0")
    check.expect("three is even", 3 % 2 == 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PASS Task 1.1")
    assert lines[1:] == ["PASS two is even (2 % 2 = 0)", "FAIL three is even"]
