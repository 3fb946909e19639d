"""Graders for Lab 3, "CPU Adam": step constants, the fused loop body, bf16 rounding, bytes moved.

Each grader compares the learner's scalar Python function with the runtime (`minioffload.kernels.adam`,
`minioffload.kernels.lowp`) and with torch. Inputs are seeded, so a verdict is the same on every run.
No answer is typed in here. Task 3.1's constants are read off one step of torch's AdamW (`torch_constants`).
Task 3.4's counts are measured: `adam._adam_inplace` runs on arrays that log every NumPy operation
(`inplace_passes`), and each pass of the other versions (the runtime's kernels, torch's copies) runs on
arrays whose reads and writes are found by what the pass does (`measured_pass`), so the counts follow the
code if the code changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ...kernels import adam
from .grading import grader

# ---------------------------------------------------------------------------------------------
# Task 3.1: the bias-corrected step size

STEPS = (1, 2, 10, 1000, 10**6)
STEP_HYPER = ((1e-3, 0.9, 0.999), (3e-4, 0.9, 0.95), (1.0, 0.5, 0.9), (2e-2, 0.0, 0.0), (1e-3, 0.99, 0.9999))
STEP_RTOL = 1e-12


def torch_constants(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt) as torch's AdamW applies them at `step`, read off one float64 step.

    torch moves a weight by -step_size * m / (sqrt(v) / bias_correction2_sqrt + eps). Two weights at 0 start
    from the state of step - 1 with m = v = 1 and get the gradient 1, so m and v stay 1 (to rounding): with
    eps = 0 the first moves by step_size * bias_correction2_sqrt, with eps = 1e20 the second by step_size / 1e20.
    """
    weights = [torch.zeros(1, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    opt = torch.optim.AdamW([{"params": [weights[0]], "eps": 0.0}, {"params": [weights[1]], "eps": 1e20}],
                            lr=lr, betas=(beta1, beta2), weight_decay=0.0, foreach=False)
    for w in weights:
        w.grad = torch.ones(1, dtype=torch.float64)
        opt.state[w] = {"step": torch.tensor(float(step - 1)), "exp_avg": torch.ones(1, dtype=torch.float64),
                        "exp_avg_sq": torch.ones(1, dtype=torch.float64)}
    opt.step()
    product, step_size = -float(weights[0].detach()), -float(weights[1].detach()) * 1e20
    return step_size, product / step_size


@grader("3.1", rebuilds=("minioffload.kernels.adam._constants",))
def step_constants(fn: Callable) -> str:
    """fn(step, lr, beta1, beta2) -> (step_size, bias_correction2_sqrt) in float64."""
    for lr, beta1, beta2 in STEP_HYPER:
        for step in STEPS:
            call = f"step_constants({step}, lr={lr}, beta1={beta1}, beta2={beta2})"
            got = fn(step, lr, beta1, beta2)
            assert isinstance(got, tuple) and len(got) == 2, (
                f"{call} returned {got!r}; expected a tuple (step_size, bias_correction2_sqrt)")
            for value, want, name, formula in zip(got, torch_constants(step, lr, beta1, beta2),
                                                  ("step_size", "bias_correction2_sqrt"),
                                                  ("lr / (1 - beta1**step)", "sqrt(1 - beta2**step)"), strict=True):
                assert isinstance(value, (int, float)) and math.isclose(value, want, rel_tol=STEP_RTOL), (
                    f"{call}: {name} is {value!r}, expected {want!r} (= {formula}, in float64 Python floats, as "
                    "torch's AdamW applies it)")
    for step in (0, -1):
        try:
            got = fn(step, 1e-3, 0.9, 0.999)
        except ValueError as err:  # math.sqrt of a negative number raises ValueError too: ask for our own
            assert "step" in str(err).lower(), (
                f"step_constants({step}, ...) raised ValueError({str(err)!r}); expected a ValueError of your own "
                f"whose message names the step: check `step >= 1` first")
            continue
        except ZeroDivisionError:
            raise AssertionError(f"step_constants({step}, ...) raised ZeroDivisionError; expected ValueError: "
                                 f"check `step >= 1` first and say so in the message") from None
        raise AssertionError(f"step_constants({step}, ...) returned {got!r}; expected ValueError: the step counts "
                             f"updates including this one, so it starts at 1")
    first, late = fn(1, 1e-3, 0.9, 0.999)[0] / 1e-3, fn(1000, 1e-3, 0.9, 0.999)[0] / 1e-3
    return (f"{len(STEPS) * len(STEP_HYPER)} cases match to {STEP_RTOL:g} relative; step 0 and -1 raise ValueError; "
            f"with beta1=0.9 the step size is {first:.0f}x lr at step 1 and {late:.0f}x lr at step 1000")


# ---------------------------------------------------------------------------------------------
# Task 3.2: one parameter's AdamW update

ELEMENT_CASES = (  # (hyper-parameters, scale of the gradients)
    ({"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}, 1.0),
    ({"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}, 1.0),
    # eps as large as sqrt(v): the place of eps (outside the square root) shows in the weights
    ({"lr": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-2, "weight_decay": 0.01}, 1e-2),
)
ELEMENT_PARAMS, ELEMENT_STEPS, ELEMENT_SEED = 32, 5, 3
ELEMENT_RTOL, ELEMENT_ATOL = 1e-5, 1e-7  # the learner works in float64, the references in float32
QUANTITIES = (("m", "exp_avg", 1), ("v", "exp_avg_sq", 2), ("p", "param", 0))  # m and v first: p depends on them
ELEMENT_HINTS = {
    "m": "m = m + (1 - beta1) * (g - m) with the raw gradient g (AdamW does not add weight_decay * p to it)",
    "v": "v = v * beta2 + (1 - beta2) * g * g",
    "p": "p = p * (1 - lr * weight_decay), then p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps): "
         "both bias corrections, eps outside the square root",
}


def _torch_steps(p0: torch.Tensor, grads: list[torch.Tensor], h: dict) -> list[tuple]:
    """(param, exp_avg, exp_avg_sq) after each step of torch's single-tensor AdamW."""
    param = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], foreach=False)
    states = []
    for g in grads:
        param.grad = g.clone()
        opt.step()
        state = opt.state[param]
        states.append(tuple(x.detach().clone() for x in (param, state["exp_avg"], state["exp_avg_sq"])))
    return states


def _ref_steps(p0: torch.Tensor, grads: list[torch.Tensor], h: dict) -> list[tuple]:
    """The same with the runtime's NumPy reference, `adam.adam_ref`."""
    p, m, v = p0.numpy().copy(), np.zeros(p0.numel(), np.float32), np.zeros(p0.numel(), np.float32)
    states = []
    for step, g in enumerate(grads, 1):
        adam.adam_ref(p, g.numpy(), m, v, step=step, decoupled=True, **h)
        states.append((p.copy(), m.copy(), v.copy()))
    return states


@grader("3.2", rebuilds=("minioffload.kernels.adam._update",))
def adam_element(fn: Callable) -> str:
    """fn(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay) -> (p, m, v), one parameter."""
    gen = torch.Generator().manual_seed(ELEMENT_SEED)
    for h, scale in ELEMENT_CASES:
        p0 = torch.randn(ELEMENT_PARAMS, generator=gen)
        grads = [scale * torch.randn(ELEMENT_PARAMS, generator=gen) for _ in range(ELEMENT_STEPS)]
        references = (("torch AdamW", _torch_steps(p0, grads, h)), ("adam.adam_ref", _ref_steps(p0, grads, h)))
        state = [(float(x), 0.0, 0.0) for x in p0]  # (p, m, v) per parameter, as the learner keeps them
        hyper = ", ".join(f"{k}={val}" for k, val in h.items())
        for step, g in enumerate(grads, 1):
            for i in range(ELEMENT_PARAMS):
                p, m, v = state[i]
                got = fn(p, float(g[i]), m, v, step, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"])
                assert isinstance(got, tuple) and len(got) == 3, (
                    f"adam_element returned {got!r}; expected a tuple (p, m, v) of the updated values")
                state[i] = tuple(float(x) for x in got)
            for short, name, index in QUANTITIES:
                for ref_name, ref in references:
                    want = ref[step - 1][index]
                    for i in range(ELEMENT_PARAMS):
                        got, expected = state[i][index], float(want[i])
                        assert math.isclose(got, expected, rel_tol=ELEMENT_RTOL, abs_tol=ELEMENT_ATOL), (
                            f"{short} ({name}) differs first, at step {step}, parameter {i}: got {got!r}, expected "
                            f"{expected!r} ({ref_name}; {hyper}; start p={float(p0[i])!r}, g={float(g[i])!r}). "
                            f"Hint: {ELEMENT_HINTS[short]}")
    decays = ", ".join(str(h["weight_decay"]) for h, _ in ELEMENT_CASES)
    return (f"{len(ELEMENT_CASES)} settings x {ELEMENT_STEPS} steps x {ELEMENT_PARAMS} parameters match torch AdamW "
            f"and adam.adam_ref to rtol {ELEMENT_RTOL:g} (weight_decay {decays})")


# ---------------------------------------------------------------------------------------------
# Task 3.3: fp32 -> bf16 bits, round to nearest even

BF16_CASES = (  # (fp32 bits, what the case is about)
    (0x3F800000, "exact in bf16, nothing to round"),
    (0x40490FDB, "pi: the dropped half is below halfway, round down"),
    (0x3F808001, "just above halfway: round up"),
    (0x3F807FFF, "just below halfway: round down"),
    (0x3F808000, "exactly halfway, the kept part is even: stay"),
    (0x3F818000, "exactly halfway, the kept part is odd: round up to even"),
    (0xBF818000, "negative, exactly halfway, odd: round up (in magnitude) to even"),
    (0x3FFF8000, "halfway, the mantissa carry goes into the exponent"),
    (0x00000000, "+0.0"),
    (0x80000000, "-0.0 keeps its sign"),
    (0x00000001, "the smallest subnormal rounds to zero"),
    (0x00008001, "a subnormal just above halfway rounds up to the smallest bf16 subnormal"),
    (0x00018000, "a subnormal, exactly halfway, odd: round up to even"),
    (0x007FFFFF, "the largest subnormal rounds up to the smallest normal"),
    (0x7F7F7FFF, "below halfway: stays the largest finite bf16"),
    (0x7F7F8000, "halfway, odd, at the top: rounds to infinity"),
    (0x7F7FFFFF, "the largest finite float rounds to infinity"),
    (0xFF7FFFFF, "the most negative finite float rounds to -infinity"),
    (0x7F800000, "+infinity stays infinity"),
    (0xFF800000, "-infinity stays -infinity"),
    (0x7FC00000, "a quiet NaN stays NaN"),
    (0x7F800001, "a NaN with only the lowest mantissa bit set stays NaN (not infinity)"),
    (0x7FFFFFFF, "a NaN with every mantissa bit set stays NaN (adding a rounding bias would carry into the sign)"),
    (0xFFFFFFFF, "a negative NaN, every bit set, stays NaN (and fits in 16 bits)"),
)
BF16_RANDOM, BF16_SEED = 10_000, 3


def _torch_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """uint32 fp32 patterns -> uint16 bf16 patterns, as torch rounds them."""
    as_float = torch.from_numpy(bits.astype(np.uint32).view(np.int32)).view(torch.float32)
    return as_float.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _is_nan32(bits: int) -> bool:
    return (bits & 0x7FFFFFFF) > 0x7F800000


def _is_nan16(bits: int) -> bool:
    return (bits & 0x7FFF) > 0x7F80


def _as_float(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(np.float32)[0])


@grader("3.3", rebuilds=("minioffload.kernels.lowp.f32_to_bf16",))
def to_bf16_bits(fn: Callable) -> str:
    """fn(fp32 bits as an int) -> bf16 bits as an int, round to nearest even; any NaN for a NaN."""
    rng = np.random.default_rng(BF16_SEED)
    random_bits = rng.integers(0, 2**32, BF16_RANDOM, dtype=np.uint64)
    cases = list(BF16_CASES) + [(int(b), "a random bit pattern") for b in random_bits]
    expected = _torch_bf16_bits(np.array([bits for bits, _ in cases], np.uint64))
    nans = 0
    for (bits, what), want in zip(cases, expected.tolist(), strict=True):
        got = fn(bits)
        call = f"to_bf16_bits(0x{bits:08X}) [{_as_float(bits)!r}: {what}]"
        assert isinstance(got, (int, np.integer)) and not isinstance(got, bool), (
            f"{call} returned {got!r}; expected an int, the bf16 bit pattern")
        assert 0 <= got <= 0xFFFF, (
            f"{call} returned 0x{int(got):X}, expected a value in 0..0xFFFF: a bf16 pattern fits in 16 bits")
        if _is_nan32(bits):
            assert _is_nan16(int(got)), (
                f"{call} returned 0x{int(got):04X}, expected a NaN (exponent bits all ones, mantissa not zero), "
                f"e.g. 0x{want:04X}: handle NaN before rounding")
            nans += 1
            continue
        assert got == want, f"{call} returned 0x{int(got):04X}, expected 0x{want:04X} (torch's rounding)"
    return (f"{len(BF16_CASES)} hand-picked cases and {BF16_RANDOM:,} random bit patterns match torch "
            f"({nans} NaNs stayed NaN)")


# ---------------------------------------------------------------------------------------------
# Task 3.4: bytes moved per parameter

MEASURE_N = 64  # elements of the arrays a pass is measured on
PASS_HYPER = {"step": 3, "lr": 1e-2, "weight_decay": 0.01}
FP32, BF16 = torch.float32, torch.bfloat16


def _fused_step(names: tuple[str, str, str, str]) -> Callable[[dict], None]:
    param, grad, exp_avg, exp_avg_sq = names
    return lambda a: adam.adam_fused(a[param], a[grad], a[exp_avg], a[exp_avg_sq], **PASS_HYPER)


# version -> its passes as (name, {array: dtype}, run(arrays)): the runtime's kernels, and torch's copies for the
# composition of three passes (chapter 3's). Which arrays a pass reads and writes is measured, not typed in.
MEASURED_VERSIONS = {
    "adam_fused": [("the fused fp32 step", {"param": FP32, "grad": FP32, "exp_avg": FP32, "exp_avg_sq": FP32},
                    _fused_step(("param", "grad", "exp_avg", "exp_avg_sq")))],
    "adam_mixed": [("the fused mixed step",
                    {"fp32 master": FP32, "bf16 grad": BF16, "exp_avg": FP32, "exp_avg_sq": FP32, "bf16 weights": BF16},
                    lambda a: adam.adam_mixed(a["fp32 master"], a["bf16 grad"], a["exp_avg"], a["exp_avg_sq"],
                                              a["bf16 weights"], dtype="bf16", **PASS_HYPER))],
    "three_pass": [("upcast", {"bf16 grad": BF16, "fp32 grad": FP32}, lambda a: a["fp32 grad"].copy_(a["bf16 grad"])),
                   ("the fused fp32 step",
                    {"param": FP32, "fp32 grad": FP32, "exp_avg": FP32, "exp_avg_sq": FP32},
                    _fused_step(("param", "fp32 grad", "exp_avg", "exp_avg_sq"))),
                   ("downcast", {"param": FP32, "bf16 weights": BF16}, lambda a: a["bf16 weights"].copy_(a["param"]))],
}


def _filled(dtypes: dict[str, torch.dtype], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: (0.1 + torch.rand(MEASURE_N, generator=g)).to(dtype) for name, dtype in dtypes.items()}


def measured_pass(dtypes: dict[str, torch.dtype], run: Callable[[dict], None]
                  ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """([(array, bytes read)], [(array, bytes written)]) per element of one pass, found by what it does: it
    writes an array whose values it changes, and reads one whose values change what it writes. Each array
    counts once, at the width of its dtype (one pass touches each element once)."""
    before = _filled(dtypes, seed=1)
    after = {name: t.clone() for name, t in before.items()}
    run(after)
    written = [name for name in dtypes if not torch.equal(after[name], before[name])]
    reads = []
    for name in dtypes:
        other = {k: t.clone() for k, t in before.items()}
        other[name] = _filled({name: dtypes[name]}, seed=2)[name]  # other values in this array alone
        run(other)
        if any(not torch.equal(other[w], after[w]) for w in written):
            reads.append(name)
    size = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in dtypes.items()}
    return [(name, size[name]) for name in reads], [(name, size[name]) for name in written]


def version_passes(version: str) -> list[tuple[str, list[tuple[str, int]], list[tuple[str, int]]]]:
    """The passes of one version with the bytes each reads and writes per parameter, measured."""
    if version == "adam_inplace":
        return inplace_passes()
    return [(label, *measured_pass(dtypes, run)) for label, dtypes, run in MEASURED_VERSIONS[version]]


VERSION_HINTS = {
    "adam_fused": "16 B is what Adam keeps per parameter in fp32 (param, grad, m, v); a pass reads all four "
                  "and writes three back",
    "adam_mixed": "bytes are counted at the width they have in memory: the gradient comes in as bf16, "
                  "the weights go out as bf16 as well as fp32",
    "three_pass": "each of the three passes reads its inputs from memory and writes its outputs back",
    "adam_inplace": "each NumPy operation is one pass over memory; an array read twice by one operation "
                    "is read once; scalars and allocating the scratch buffer cost nothing",
}
INPLACE_ARGS = {"step": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                "decoupled": True}


def inplace_passes(n: int = 8) -> list[tuple[str, list[tuple[str, int]], list[tuple[str, int]]]]:
    """Run `adam._adam_inplace` (weight_decay=0, decoupled) on logging arrays; return its passes.

    Each NumPy ufunc call is one pass: it reads each distinct n-element input once and writes its
    outputs. Scalars are not memory traffic. Arrays the function makes itself are named scratch, scratch2...
    Only ufunc calls are seen: `a[:] = b` or `np.copyto` would go uncounted (`_adam_inplace` uses neither).
    """
    passes: list = []
    names: dict[int, str] = {}

    def name_of(array: np.ndarray) -> str:
        address = array.__array_interface__["data"][0]
        if address not in names:
            extra = sum(name.startswith("scratch") for name in names.values())
            names[address] = "scratch" if extra == 0 else f"scratch{extra + 1}"
        return names[address]

    class Logged(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
            plain = [x.view(np.ndarray) if isinstance(x, Logged) else x for x in inputs]
            arrays = [x for x in plain if isinstance(x, np.ndarray) and x.size == n]
            outs = tuple(x.view(np.ndarray) for x in out) if out else None
            result = getattr(ufunc, method)(*plain, **({"out": outs} if outs else {}), **kwargs)
            written = list(outs) if outs else [result]
            read_names = list(dict.fromkeys(name_of(x) for x in arrays))  # distinct, in order
            args = [name_of(x) if isinstance(x, np.ndarray) and x.size == n else "c" for x in plain]
            label = f"{', '.join(name_of(x) for x in written)} = {ufunc.__name__}({', '.join(args)})"
            passes.append((label, [(a, 4) for a in read_names], [(name_of(x), 4) for x in written]))
            if out:  # hand back the caller's own (logged) arrays: `a *= c` rebinds a to this
                return out[0] if len(out) == 1 else out
            return result.view(Logged)

    arrays = {name: np.full(n, value, np.float32).view(Logged)
              for name, value in (("param", 1.0), ("grad", 0.5), ("exp_avg", 0.1), ("exp_avg_sq", 0.01))}
    for name, array in arrays.items():
        names[array.__array_interface__["data"][0]] = name
    adam._adam_inplace(*arrays.values(), *INPLACE_ARGS.values())
    return passes


def _total(passes) -> int:
    return sum(b for _, reads, writes in passes for _, b in reads + writes)


def _breakdown(passes) -> str:
    def side(pairs):
        return " + ".join(f"{name} {b}" for name, b in pairs)
    return "; ".join(f"{label}: read {side(reads)}, write {side(writes)}" for label, reads, writes in passes)


@grader("3.4", nothing_to_refuse="a count of bytes per version of the update; no runtime function computes it")
def bytes_moved(fn: Callable) -> str:
    """fn(version) -> bytes read plus bytes written per parameter by one Adam step of that version."""
    versions = {version: version_passes(version) for version in (*MEASURED_VERSIONS, "adam_inplace")}
    for version, passes in versions.items():
        expected, got = _total(passes), fn(version)
        assert got == expected and not isinstance(got, bool), (
            f"bytes_moved({version!r}) returned {got!r}, expected {expected} B/param "
            f"({len(passes)} pass{'es' if len(passes) > 1 else ''}: {_breakdown(passes)}). "
            f"Hint: {VERSION_HINTS[version]}")
    inplace = versions["adam_inplace"]
    return (f"all {len(versions)} versions match: fused {fn('adam_fused')}, mixed {fn('adam_mixed')}, "
            f"three-pass {fn('three_pass')}, in-place NumPy {fn('adam_inplace')} B/param "
            f"({len(inplace)} passes, {_total(inplace) / _total(versions['adam_fused']):.1f}x the fused pass)")
