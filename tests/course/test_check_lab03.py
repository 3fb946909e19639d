"""Lab 3 verdicts: right answers pass, plausible mistakes fail with a reason, stubs say TODO."""

import math
import re

import numba
import numpy as np
from grader_harness import mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

from minioffload.course import check
from minioffload.course.check import lab03, lab03_kernel
from minioffload.kernels import adam

# ---------------------------------------------------------------------------------------------
# reference answers


def step_constants(step, lr, beta1, beta2):
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return lr / (1 - beta1**step), math.sqrt(1 - beta2**step)


def adam_element(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    step_size, bias_correction2_sqrt = step_constants(step, lr, beta1, beta2)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    denom = math.sqrt(v) / bias_correction2_sqrt + eps
    return p - step_size * m / denom, m, v


def to_bf16_bits(bits):
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return (bits >> 16) | 0x0040
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


BYTES = {"adam_fused": 28, "adam_mixed": 28, "three_pass": 40, "adam_inplace": 120}


def _kernel(loop, decoupled=True, bias_correction=True):
    """A learner's Task 3.5 kernel, compiled with parallel=True, looping with `loop` (prange or range)."""
    def body(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        c1 = 1 - beta1**step if bias_correction else 1.0
        c2 = math.sqrt(1 - beta2**step) if bias_correction else 1.0
        for i in loop(param.size):
            g = grad[i] + (0.0 if decoupled else weight_decay * param[i])
            m = exp_avg[i] + (1 - beta1) * (g - exp_avg[i])
            v = exp_avg_sq[i] * beta2 + (1 - beta2) * g * g
            exp_avg[i] = m
            exp_avg_sq[i] = v
            p = param[i] * (1 - lr * weight_decay) if decoupled else param[i]
            param[i] = p - lr / c1 * m / (math.sqrt(v) / c2 + eps)
    return numba.njit(parallel=True)(body)


adamw_fused = _kernel(numba.prange)


def numpy_passes(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """Right, but one NumPy pass per operation (the runtime's in-place version)."""
    adam.adam_inplace(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay)


def diagnose_with(*, moments_ignored=False, decay_guessed=False, bf16_ignored=False, uniform_is=None,
                  small_is=None, fixes=None):
    """A correct answer to Task 3.6, with switches that turn it into one plausible mistake at a time."""
    def diagnose_adam(run):
        ours, theirs = run["ours"], run["torch"]

        def differs(*keys):
            return any(not np.array_equal(o[k], t[k]) for o, t in zip(ours, theirs, strict=True) for k in keys)

        if decay_guessed and run["hyper"]["weight_decay"] and differs("param"):
            cause = "l2_decay"
        elif not differs("param", "exp_avg", "exp_avg_sq"):
            cause = "bias_step" if bf16_ignored else "truncation"
        elif differs("exp_avg", "exp_avg_sq") and not moments_ignored:
            cause = "l2_decay"
        else:
            g, p0 = run["grads"][0], run["p0"]
            ratio = np.abs(ours[0]["param"] - p0) / np.abs(theirs[0]["param"] - p0)
            uniform = np.median(ratio[np.abs(g) < 1e-5]) > 0.5 * np.median(ratio[np.abs(g) > 1e-2])
            cause = (uniform_is or "bias_step") if uniform else (small_is or "eps_inside")
        fix = {"bias_step": {"bias_step": 0}, "eps_inside": {"eps": "outside"}, "l2_decay": {"decay": "decoupled"},
               "truncation": {"rounding": "nearest_even"}}[cause]
        return cause, (fixes or {}).get(cause, fix)
    return diagnose_adam


REFERENCE = {"3.1": step_constants, "3.2": adam_element, "3.3": to_bf16_bits, "3.4": BYTES.__getitem__,
             "3.5": adamw_fused, "3.6": diagnose_with()}


# ---------------------------------------------------------------------------------------------
# plausible mistakes, each with a phrase its verdict must contain


def no_bias_correction(step, lr, beta1, beta2):
    if step < 1:
        raise ValueError("step")
    return lr, 1.0


def no_validation(step, lr, beta1, beta2):
    return lr / (1 - beta1**step), math.sqrt(1 - beta2**step)


def refuses_only_zero(step, lr, beta1, beta2):
    if step == 0:
        raise ValueError("step")
    return no_validation(step, lr, beta1, beta2)


def in_float32(step, lr, beta1, beta2):
    if step < 1:
        raise ValueError("step")
    f = np.float32
    return float(f(lr) / (f(1) - f(beta1) ** step)), float(np.sqrt(f(1) - f(beta2) ** step))


def element_without_bias_correction(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    return p - lr * m / (math.sqrt(v) + eps), m, v


def element_eps_inside_sqrt(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    step_size, bias_correction2_sqrt = step_constants(step, lr, beta1, beta2)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    return p - step_size * m / math.sqrt(v / bias_correction2_sqrt**2 + eps), m, v


def element_l2_decay(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    return adam_element(p, g + weight_decay * p, m, v, step, lr, beta1, beta2, eps, 0.0)


def element_forgot_one_minus_beta2(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    step_size, bias_correction2_sqrt = step_constants(step, lr, beta1, beta2)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + g * g
    return p - step_size * m / (math.sqrt(v) / bias_correction2_sqrt + eps), m, v


def bf16_truncate(bits):
    return bits >> 16


def bf16_ties_away(bits):
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return (bits + 0x8000) >> 16


def bf16_forgot_nan(bits):
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def bf16_as_float_bits(bits):  # returns the 16 bits in the wrong half: the low ones
    return to_bf16_bits(bits) << 16


WRONG = [  # (task, function, a phrase the verdict must contain)
    ("3.1", no_bias_correction, "step_size is 0.001, expected 0.01"),
    ("3.1", no_validation, "raised ZeroDivisionError; expected ValueError"),
    ("3.1", refuses_only_zero, "raised ValueError('math domain error'); expected a ValueError of your own"),
    ("3.1", in_float32, "in float64"),
    ("3.1", lambda *args: step_constants(*args)[0], "expected a tuple"),
    ("3.2", element_without_bias_correction, "p (param) differs first, at step 1"),
    ("3.2", element_eps_inside_sqrt, "p (param) differs first, at step 1"),
    ("3.2", element_l2_decay, "m (exp_avg) differs first, at step 1"),
    ("3.2", element_forgot_one_minus_beta2, "v (exp_avg_sq) differs first, at step 1"),
    ("3.2", lambda *args: adam_element(*args)[0], "expected a tuple (p, m, v)"),
    ("3.3", bf16_truncate, "just above halfway: round up] returned 0x3F80, expected 0x3F81"),
    ("3.3", bf16_ties_away, "exactly halfway, the kept part is even"),
    ("3.3", bf16_forgot_nan, "expected a NaN"),
    ("3.3", bf16_as_float_bits, "fits in 16 bits"),
    ("3.3", lambda bits: float(to_bf16_bits(bits)), "expected an int"),
    ("3.4", {**BYTES, "adam_fused": 16}.__getitem__, "16 B is what Adam keeps"),
    ("3.4", {**BYTES, "adam_mixed": 32}.__getitem__, "write fp32 master 4 + exp_avg 4 + exp_avg_sq 4 + bf16 weights 2"),
    ("3.4", {**BYTES, "three_pass": 28}.__getitem__, "upcast: read bf16 grad 2, write fp32 grad 4"),
    ("3.4", {**BYTES, "adam_inplace": 124}.__getitem__, "scratch = multiply(grad, grad): read grad 4, write scratch 4"),
    ("3.5", numpy_passes, "too slow"),
    ("3.5", _kernel(range), "the loop uses `range`"),
    ("3.5", numba.njit(_kernel(numba.prange).py_func), "compiled without parallel=True"),
    ("3.5", _kernel(numba.prange, decoupled=False), "applied weight decay the Adam way"),
    ("3.5", _kernel(numba.prange, bias_correction=False), "left out the bias corrections"),
    ("3.5", lambda *args: adamw_fused(*args) or args[0].copy(), "return None"),
    ("3.6", diagnose_with(moments_ignored=True), "the bias corrections and eps act after the moments"),
    ("3.6", diagnose_with(decay_guessed=True), "a decay added to the gradient would change both moments"),
    ("3.6", diagnose_with(bf16_ignored=True), "only the bf16 copies differ"),
    ("3.6", diagnose_with(uniform_is="eps_inside"), "every weight's by about the same factor"),
    ("3.6", diagnose_with(small_is="bias_step"), "a step count off by one would not do"),
    ("3.6", diagnose_with(small_is="l2_decay"), "weight_decay is 0 here"),
    ("3.6", diagnose_with(fixes={"truncation": {"rounding": "nearest"}}), "one of ('nearest_even', 'truncate')"),
    ("3.6", diagnose_with(fixes={"bias_step": {"bias_step": -1}}), "divide by 1 - beta**0 = 0"),
    ("3.6", diagnose_with(fixes={"bias_step": {"bias_step": 1}}), "the update is still not torch's"),
    ("3.6", diagnose_with(fixes={"l2_decay": {"decay": "decoupled", "eps": "inside"}}), "still not torch's"),
    ("3.6", diagnose_with(fixes={"eps_inside": {"eps": "outside", "eps_value": 0.0}}), "a fix may change only"),
]


test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_are_the_same_on_every_run = same_verdict_every_run(  # 3.5 times
    REFERENCE, ("3.1", "3.2", "3.3", "3.4", "3.6"))


def test_any_nan_pattern_is_accepted_for_a_nan():
    def other_nans(bits):
        return 0xFFFF if (bits & 0x7FFFFFFF) > 0x7F800000 else to_bf16_bits(bits)
    assert check.grade("3.3", other_nans).passed


def test_the_runtime_rounding_is_what_task_3_3_asks_for():
    from minioffload.kernels.lowp import f32_to_bf16
    assert check.grade("3.3", lambda bits: int(f32_to_bf16(np.array([bits], np.uint32).view(np.float32)[0]))).passed


def test_the_in_place_count_is_thirteen_numpy_passes_of_120_bytes():
    passes = lab03.inplace_passes()
    assert len(passes) == 13 and lab03._total(passes) == 120
    assert passes[4] == ("scratch = multiply(grad, grad)", [("grad", 4)], [("scratch", 4)])
    assert passes[-1] == ("param = subtract(param, scratch)", [("param", 4), ("scratch", 4)], [("param", 4)])


def test_the_measured_passes_are_the_ones_chapter_3_counts():
    assert lab03.version_passes("adam_fused") == [
        ("the fused fp32 step", [("param", 4), ("grad", 4), ("exp_avg", 4), ("exp_avg_sq", 4)],
         [("param", 4), ("exp_avg", 4), ("exp_avg_sq", 4)])]
    mixed = lab03.version_passes("adam_mixed")[0]
    assert mixed[1] == [("fp32 master", 4), ("bf16 grad", 2), ("exp_avg", 4), ("exp_avg_sq", 4)]
    assert mixed[2] == [("fp32 master", 4), ("exp_avg", 4), ("exp_avg_sq", 4), ("bf16 weights", 2)]  # out only
    three = lab03.version_passes("three_pass")
    assert [(label, lab03._total([(label, r, w)])) for label, r, w in three] == [
        ("upcast", 6), ("the fused fp32 step", 28), ("downcast", 6)]


def test_torch_constants_are_the_bias_corrections():
    for step, lr, beta1, beta2 in ((1, 1e-3, 0.9, 0.999), (10**6, 3e-4, 0.99, 0.9999), (3, 1.0, 0.0, 0.0)):
        step_size, bc2_sqrt = lab03.torch_constants(step, lr, beta1, beta2)
        assert math.isclose(step_size, lr / (1 - beta1**step), rel_tol=1e-14)
        assert math.isclose(bc2_sqrt, math.sqrt(1 - beta2**step), rel_tol=1e-14)


def test_the_kernels_fail_line_names_its_fraction_of_the_roofline():
    verdict = check.grade("3.5", numpy_passes)
    assert re.search(r"too slow: \d\.\d\d of the roofline", verdict.detail), str(verdict)
    assert f"below {lab03_kernel.MIN_ROOFLINE_FRACTION}" in verdict.detail


def test_a_kernel_that_skips_an_element_fails_on_agreement_before_any_timing():
    @numba.njit(parallel=True)
    def skips_the_last(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        adamw_fused(param[:-1], grad[:-1], exp_avg[:-1], exp_avg_sq[:-1], step, lr, beta1, beta2, eps, weight_decay)

    verdict = check.grade("3.5", skips_the_last)
    assert verdict.status == "FAIL" and "element 1000 of 1001" in verdict.detail, str(verdict)
