"""Graders for Lab 1, "The memory wall": estimation problems, checked against `predict.memory` and the
table.

Each task poses a situation (a model, a precision, a placement, a preset of the hardware table) and asks for a
quantity; the learner derives it and returns it with its unit (Task 1.1: bytes per parameter, a plain number;
Task 1.4: a placement). `lab01_units.check` reads the unit and names unit mistakes (GiB for GB, bits for bytes, a
prefix). Each grader also computes the values a plausible wrong derivation gives (the runtime's own accounting with
one part left out) and names the mistake when the learner's answer is one of them. The expected values come from
`memory` and `profiles`, never typed in here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...machine import profiles
from ...predict import memory
from .grading import grader
from .lab01_units import check

PRESETS = list(profiles.PRESETS.values())


def _part(precision: str, optimizer: str, names: tuple[str, ...], placement: str = "device") -> int:
    """Bytes per parameter of the named parts of a footprint (0 for parts it does not have)."""
    return sum(p.bytes_per_param for p in memory.footprint(precision, optimizer, placement).parts if p.name in names)


# ---------------------------------------------------------------------------------------------
# Task 1.1: bytes per parameter, everything on the GPU


def _per_param_mistakes(precision: str, optimizer: str) -> dict[str, float]:
    """{mistake: the bytes per parameter it gives} for one precision and optimizer."""
    right = memory.footprint(precision, optimizer).per_param()
    states = memory.footprint(precision, optimizer).parts[-1].bytes_per_param  # one optimizer state
    return {
        "forgot the fp32 master copy (mixed precision: the optimizer updates an fp32 copy of each weight)":
            right - _part(precision, optimizer, ("master",)),
        "counted Adam's states once (Adam keeps two: exp_avg and exp_avg_sq)":
            right - states if optimizer in ("adam", "adamw") else right,
        "forgot the gradients (one per weight, in the weights' dtype)": right - _part(precision, optimizer, ("grads",)),
        "counted bits, not bytes (a byte is 8 bits)": 8 * right,
    }


@grader("1.1", rebuilds=("minioffload.predict.memory.footprint",))
def bytes_per_param(fn: Callable) -> str:
    """fn(precision, optimizer) -> bytes per parameter with everything on the device."""
    pairs = [(p, o) for p in memory.PRECISIONS for o in memory.OPTIMIZERS]  # fp32 first
    got = {}
    for precision, optimizer in pairs:
        got[precision, optimizer] = answer = fn(precision, optimizer)
        assert isinstance(answer, (int, float)) and not isinstance(answer, bool), (
            f"bytes_per_param({precision!r}, {optimizer!r}) returned {answer!r}; expected a number of bytes per "
            f"parameter (an int)")
    for precision, optimizer in pairs:
        expected = memory.footprint(precision, optimizer).per_param()
        answer = got[precision, optimizer]
        if answer == expected:
            continue
        named = [m for m, value in _per_param_mistakes(precision, optimizer).items() if value == answer]
        consistent = [m for m in named if all(got[p, o] == _per_param_mistakes(p, o)[m] for p, o in pairs
                                              if got[p, o] != memory.footprint(p, o).per_param())]
        why = f": that is what you get if you {(consistent or named)[0]}" if named else ""
        raise AssertionError(f"bytes_per_param({precision!r}, {optimizer!r}) returned {answer!r}, expected "
                             f"{expected} B/param{why}")
    return (f"all {len(pairs)} precision x optimizer pairs match; mixed-precision Adam = "
            f"{got['mixed_bf16', 'adam']} B/param, fp32 Adam = {got['fp32', 'adam']}")


# ---------------------------------------------------------------------------------------------
# Task 1.2: the activation memory of a model


ACTIVATION_CASES = [  # (seq_len, batch_size, hidden, num_heads, num_layers)
    (2048, 8, 4096, 32, 32), (1024, 1, 768, 12, 12), (128, 64, 512, 8, 6), (4096, 2, 12288, 96, 96), (1, 1, 64, 1, 1),
]


def _activations(s: int, b: int, h: int, a: int, layers: int, flash: bool) -> float:
    return layers * memory.activation_bytes_per_layer(s, b, h, a, flash_attention=flash)


@grader("1.2", rebuilds=(
    "minioffload.predict.memory.activation_bytes_per_layer",
    "minioffload.predict.memory.activation_bytes",
))
def activation_memory(fn: Callable) -> str:
    """fn(seq_len, batch_size, hidden, num_heads, num_layers, flash_attention) -> (value, unit), all layers."""
    for case in ACTIVATION_CASES:
        s, b, h, a, layers = case
        for flash in (False, True):
            scores = 0 if flash else _activations(s, b, h, a, layers, False) - _activations(s, b, h, a, layers, True)
            expected = _activations(*case, flash)
            mistakes = {
                "count one layer, not all of them": expected / layers,
                "leave out the attention scores (a x s x s per sequence, 5 B each)": expected - scores,
                "count the scores of one head only (there are a x s x s scores per sequence)":
                    expected - scores + scores / a,
                "keep the attention scores although flash attention recomputes them":
                    _activations(*case, False) if flash else expected,
            }
            check(fn(*case, flash), expected, "bytes",
                  f"activation_memory{(*case, flash)}", mistakes)
    case = ACTIVATION_CASES[0]
    full, flash = _activations(*case, False), _activations(*case, True)
    return (f"{2 * len(ACTIVATION_CASES)} cases match; 6.7B-sized model, 8 x 2048 tokens: {full / memory.GB:.0f} GB, "
            f"{flash / memory.GB:.0f} GB with flash attention")


# ---------------------------------------------------------------------------------------------
# Task 1.3: the largest model a GPU holds


@grader("1.3", rebuilds=("minioffload.predict.memory.max_params_that_fit",))
def largest_model(fn: Callable) -> str:
    """fn(hw, placement) -> (value, unit): parameters of the largest model whose mixed-bf16 Adam state on the
    device fits hw.device_memory (activations ignored), placement "device" or "optimizer_cpu"."""
    for hw in PRESETS:
        for placement in ("device", "optimizer_cpu"):
            fp = memory.footprint("mixed_bf16", "adam", placement)
            expected = memory.max_params_that_fit(hw.device_memory, fp)
            right = fp.per_param("device")
            everything = memory.footprint("mixed_bf16", "adam").per_param()
            mistakes = {
                "keep the fp32 master copy out of the count, or count Adam's states once (12 B/param)":
                    hw.device_memory / (everything - 4),
                "put the whole state on the GPU whatever the placement (16 B/param)": hw.device_memory / everything,
                "keep the gradients on the GPU too (ZeRO-Offload sends them to the host as they are made)":
                    hw.device_memory / (right + _part("mixed_bf16", "adam", ("grads",))),
                "count the GPU's memory in GiB (2**30 B) where the table sells it in GB (10**9 B)":
                    expected * memory.GB / memory.GiB,
            }
            if placement == "device":
                mistakes.pop("put the whole state on the GPU whatever the placement (16 B/param)")
            check(fn(hw, placement), expected, "params", f"largest_model({hw.name!r}, {placement!r})", mistakes)
    h100 = profiles.preset("h100-sxm")
    best = memory.max_params_that_fit(h100.device_memory, memory.footprint("mixed_bf16", "adam", "optimizer_cpu"))
    return (f"all {2 * len(PRESETS)} preset x placement cases match; with the optimizer on the CPU the {h100.name} "
            f"holds {best / 1e9:.0f}B parameters")


# ---------------------------------------------------------------------------------------------
# Task 1.4: the least offloaded placement that fits


def _zero_count(num_params: float, hw: profiles.Hardware) -> str | None:
    """The decision with ZeRO's count of the host bytes (a 16-bit gradient, no staging buffer, one copy on NVMe)."""
    skip = {"staging", "upload", "previous"}
    for placement in memory.PLACEMENTS:
        fp = memory.footprint("mixed_bf16", "adam", placement)
        on = {tier: sum(p.bytes_per_param for p in fp.parts if p.tier == tier and p.name not in skip)
              for tier in ("device", "host")}
        if fp.parts and any(p.name == "grads" and p.tier == "host" for p in fp.parts):
            on["host"] -= 2  # ZeRO: the gradient in the model's 16 bits, where the engine sums in fp32
        if num_params * on["device"] <= hw.device_memory and num_params * on["host"] <= hw.host_memory:
            return placement
    return None


def _hosts(hw: profiles.Hardware) -> list[profiles.Hardware]:
    """The preset and the same GPU with less host memory: host memory decides between the placements too."""
    return [hw, *(dataclasses.replace(hw, host_memory=gib * memory.GiB) for gib in (64, 192, 1024))]


@grader("1.4", rebuilds=("minioffload.predict.memory.first_placement_that_fits",))
def first_placement(fn: Callable) -> str:
    """fn(num_params, hw) -> the least offloaded placement whose mixed-bf16 Adam state fits hw's device and host
    memory (the host bytes the engine allocates; NVMe unbounded), or None."""
    cases = [(name, n, hw) for name, n in {**memory.MODELS, "70B": 70e9}.items()
             for preset in PRESETS for hw in _hosts(preset)]
    answers = {}
    for name, n, hw in cases:
        answers[name, hw] = got = fn(n, hw)
        assert got is None or got in memory.PLACEMENTS, (
            f"first_placement({name}, {hw.name}) returned {got!r}; expected one of {memory.PLACEMENTS} or None")
    wrong = [(name, n, hw) for name, n, hw in cases
             if answers[name, hw] != memory.first_placement_that_fits(n, hw.device_memory, host_bytes=hw.host_memory)]
    if wrong:
        name, n, hw = wrong[0]
        expected = memory.first_placement_that_fits(n, hw.device_memory, host_bytes=hw.host_memory)
        said = (f"{name} on {hw.name} ({hw.device_memory / memory.GB:.0f} GB GPU, {hw.host_memory / memory.GiB:.0f} "
                f"GiB host): you returned {answers[name, hw]!r}, expected {expected!r}")
        if all(answers[c[0], c[2]] == _zero_count(c[1], c[2]) for c in cases):
            raise AssertionError(f"{said}. Your answers follow ZeRO's count of host memory; count what the engine "
                                 f"allocates (a pinned 16-bit staging buffer and an fp32 gradient sum)")
        if all(answers[c[0], c[2]] == memory.first_placement_that_fits(c[1], c[2].device_memory) for c in cases):
            raise AssertionError(f"{said}. Your answers ignore host memory: a placement must fit the host as well")
        raise AssertionError(said)
    return f"{len(cases)} model x GPU x host memory cases match"


# ---------------------------------------------------------------------------------------------
# Task 1.5: the update's time at the speed of memory


@grader("1.5", nothing_to_refuse=(
    "a figure from the hardware table and a count of bytes; no runtime function computes it"
))
def update_time(fn: Callable) -> str:
    """fn(num_params, hw) -> (value, unit): the least time one fp32 AdamW update of num_params takes on hw's
    host, moving only the bytes it must at hw.host_bandwidth."""
    for hw in PRESETS:
        for n in (7e9, 124e6, 70e9):
            expected = profiles.ADAM_BYTES_PER_PARAM * n / hw.host_bandwidth
            per_byte = n / hw.host_bandwidth
            mistakes = {
                "count only what the update reads (param, grad, exp_avg, exp_avg_sq), not what it writes back":
                    16 * per_byte,
                "count only what it writes (param, exp_avg, exp_avg_sq), not what it reads": 12 * per_byte,
                "write the gradient back too (the update only reads it)": 32 * per_byte,
                "count the bandwidth in bits per second or the bytes in bits": 8 * expected,
            }
            check(fn(n, hw), expected, "seconds", f"update_time({n:.3g}, {hw.name!r})", mistakes)
    h100 = profiles.preset("h100-sxm")
    return (f"all {3 * len(PRESETS)} cases match; a 7B update on the {h100.name} preset takes at least "
            f"{profiles.ADAM_BYTES_PER_PARAM * 7e9 / h100.host_bandwidth:.1f} s")
