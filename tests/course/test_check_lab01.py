"""Lab 1 verdicts: right estimates pass in any unit they are written in, planted mistakes fail naming the mistake
(a wrong unit, the fp32 master copy forgotten, Adam's states counted once ...), stubs say TODO."""

import pytest
from grader_harness import assert_fails, assert_passes, mistakes_fail, reference_passes, stubs_are_todo

from minioffload.course.check import lab01_units
from minioffload.machine import profiles
from minioffload.predict import memory
from minioffload.units import GB, GiB

# ---------------------------------------------------------------------------------------------
# right answers, each derived here the way a learner would (not read off the runtime)

MODEL_BYTES = {"fp32": 4, "mixed_fp16": 2, "mixed_bf16": 2, "bf16": 2}
STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1}


def bytes_per_param(precision, optimizer, master=True, states=None):
    model = MODEL_BYTES[precision]
    state = 2 if precision == "bf16" else 4
    has_master = master and precision.startswith("mixed")
    return 2 * model + (state if has_master else 0) + (states or STATES[optimizer]) * state


def activation_memory(s, b, h, a, layers, flash, scores=True, heads=True, all_layers=True, unit="GB"):
    per_layer = 34 * s * b * h + (0 if flash or not scores else 5 * (a if heads else 1) * s * s * b)
    total = per_layer * (layers if all_layers else 1)
    return total / {"GB": GB, "GiB": GiB}[unit], unit


def largest_model(hw, placement, per_param=None):
    on_device = per_param or (16 if placement == "device" else 2)
    return hw.device_memory / on_device / 1e9, "B params"


HOST = {"device": (16, 0), "optimizer_cpu": (2, 18), "optimizer_nvme": (2, 6), "params_cpu": (0, 20),
        "params_nvme": (0, 6)}
ZERO_HOST = {"device": (16, 0), "optimizer_cpu": (2, 14), "optimizer_nvme": (2, 2), "params_cpu": (0, 16),
             "params_nvme": (0, 2)}


def first_placement(num_params, hw, table=HOST, use_host=True):
    for placement, (device, host) in table.items():
        if num_params * device <= hw.device_memory and (not use_host or num_params * host <= hw.host_memory):
            return placement
    return None


def update_time(num_params, hw, bytes_per=28, unit="s"):
    seconds = num_params * bytes_per / hw.host_bandwidth
    return (seconds * 1e3, "ms") if unit == "ms" else f"{seconds:.4g} {unit}"


REFERENCE = {"1.1": bytes_per_param, "1.2": activation_memory, "1.3": largest_model, "1.4": first_placement,
             "1.5": update_time}


# ---------------------------------------------------------------------------------------------
# planted mistakes, each with a phrase its FAIL must contain

WRONG = [
    ("1.1", lambda p, o: bytes_per_param(p, o, master=False), "forgot the fp32 master copy"),
    ("1.1", lambda p, o: bytes_per_param(p, o, states=1), "counted Adam's states once"),
    ("1.1", lambda p, o: 8 * bytes_per_param(p, o), "counted bits, not bytes"),
    ("1.1", lambda p, o: 16, "expected 12 B/param"),  # the famous number for every setup: fp32 SGD is first to differ
    ("1.2", lambda *case: activation_memory(*case, unit="GiB")[0], "a bare float"),
    ("1.2", lambda *case: (activation_memory(*case, unit="GiB")[0], "GB"), "your number is in GiB"),
    ("1.2", lambda *case: (activation_memory(*case)[0], "GiB"), "your number is in GB"),
    ("1.2", lambda *case: (8 * activation_memory(*case)[0], "Gb"), "is a unit of bits"),
    ("1.2", lambda *case: (8 * activation_memory(*case)[0], "GB"), "bits for bytes"),
    ("1.2", lambda *case: (1e3 * activation_memory(*case)[0], "GB"), "off by a factor of 10**3"),
    ("1.2", lambda *case: activation_memory(*case, all_layers=False), "count one layer"),
    ("1.2", lambda *case: activation_memory(*case, scores=False), "leave out the attention scores"),
    ("1.2", lambda *case: activation_memory(*case, heads=False), "scores of one head only"),
    ("1.2", lambda s, b, h, a, n, flash: activation_memory(s, b, h, a, n, False), "flash attention recomputes"),
    ("1.2", lambda *case: (activation_memory(*case)[0], "s"), "measures seconds"),
    ("1.2", lambda *case: (activation_memory(*case)[0], "gigabytes"), "unknown unit"),
    ("1.3", lambda hw, placement: largest_model(hw, placement, per_param=12), "fp32 master copy"),
    ("1.3", lambda hw, placement: largest_model(hw, "device"), "whatever the placement"),
    ("1.3", lambda hw, placement: largest_model(hw, placement, per_param=None if placement == "device" else 4),
     "keep the gradients on the GPU"),
    ("1.3", lambda hw, placement: (hw.device_memory / GiB * GB / (16 if placement == "device" else 2), "params"),
     "in GiB"),
    ("1.3", lambda hw, placement: (largest_model(hw, placement)[0], "B"), "measures bytes"),
    ("1.4", lambda n, hw: first_placement(n, hw, table=ZERO_HOST), "ZeRO's count of host memory"),
    ("1.4", lambda n, hw: first_placement(n, hw, use_host=False), "ignore host memory"),
    ("1.4", lambda n, hw: "offload", "expected one of"),
    ("1.5", lambda n, hw: update_time(n, hw, bytes_per=16), "only what the update reads"),
    ("1.5", lambda n, hw: update_time(n, hw, bytes_per=32), "write the gradient back"),
    ("1.5", lambda n, hw: update_time(n, hw, bytes_per=28 * 8), "bits"),
    ("1.5", lambda n, hw: update_time(n, hw, unit="ms")[0], "a bare float"),
    ("1.5", lambda n, hw: (update_time(n, hw, unit="ms")[0], "s"), "ms is 1/1000 s"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)


@pytest.mark.parametrize("unit", ["GB", "GiB", "MB", "TB", "B"])
def test_a_right_size_passes_in_any_byte_unit(unit):
    size = lab01_units.UNITS[unit][1]
    assert_passes("1.2", lambda *case: (activation_memory(*case)[0] * GB / size, unit))
    assert_passes("1.2", lambda *case: f"{activation_memory(*case)[0] * GB / size:.6g} {unit}")


def test_an_estimate_rounded_to_three_digits_passes_and_one_off_by_two_percent_fails():
    assert_passes("1.5", lambda n, hw: f"{28 * n / hw.host_bandwidth:.3g} s")
    assert_fails("1.5", lambda n, hw: (1.02 * 28 * n / hw.host_bandwidth, "s"), "expected")


def test_the_expected_values_are_the_runtimes():
    h100 = profiles.preset("h100-sxm")
    assert bytes_per_param("mixed_bf16", "adam") == memory.footprint("mixed_bf16", "adam").per_param() == 16
    assert largest_model(h100, "optimizer_cpu")[0] * 1e9 == memory.max_params_that_fit(
        h100.device_memory, memory.footprint("mixed_bf16", "adam", "optimizer_cpu"))
    assert first_placement(70e9, h100) == memory.first_placement_that_fits(70e9, h100.device_memory,
                                                                           host_bytes=h100.host_memory)
