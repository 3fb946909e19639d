"""Grader for Lab 3's main task, "the fused kernel": one Numba `prange` pass of AdamW, timed against the roofline.

The learner's `adamw_fused(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)` updates
(n,) fp32 arrays in place. It is graded on two things, in this order:

1. agreement, step after step, with torch's `AdamW(foreach=False)` and the runtime's `adam.adam_ref`, with weight
   decay and with the bias corrections that matter in the first steps. When it disagrees, the update is also run
   the wrong ways a learner tends to write it (the runtime's reference with Adam's L2 decay, or with the bias
   corrections switched off), and a match names the mistake;
2. speed: the median, over interleaved rounds, of the roofline kernel's time (`hardware._seven_streams`, Adam's
   28 bytes per parameter and no arithmetic, on arrays as large as the learner's) over the learner's time: the
   fraction of this machine's memory bandwidth the learner's pass turns into updates. A fused parallel pass
   clears `MIN_ROOFLINE_FRACTION`; NumPy, one pass per operation, cannot.

A compiled loop that never became parallel (`range` where `prange` was meant, or `njit` without `parallel=True`)
fails by name before any timing: on a shared machine one thread can come close to two.

This is not a benchmark (chapter 3 and `bench/adam.py` compare versions side by side) and holds no kernel of its own
but the roofline's.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba.core.errors import NumbaWarning

from ...kernels import adam
from ...machine import measure as hardware
from .grading import grader

AGREE_CASES = (  # (hyper-parameters, scale of the gradients); each runs AGREE_STEPS steps on AGREE_N parameters
    ({"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}, 1.0),
    ({"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}, 1.0),
    ({"lr": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-2, "weight_decay": 0.01}, 1e-2),  # eps as large as sqrt(v)
)
AGREE_N, AGREE_STEPS, AGREE_SEED = 1001, 5, 5  # an odd size: a loop that skips the tail shows
# float32 references, a learner who may compute in float64: relative to each element, and absolute relative to the
# largest element of the array (where g - m cancels, the relative error of one element can be large)
AGREE_RTOL, AGREE_ATOL = 1e-5, 1e-6

TIME_N = 10_000_000  # fp32 parameters: 4 arrays of 40 MB for the learner, 4 more for the roofline
TIME_ROUNDS = 7  # interleaved rounds (learner, roofline), after one warm-up call of each
MIN_ROOFLINE_FRACTION = 0.35  # measured on the 2-core machine under load: fused 0.46-0.82, NumPy 0.06-0.28


def _state(n: int, seed: int, scale: float) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(scale * rng.standard_normal(n)).astype(np.float32) for _ in range(AGREE_STEPS)]
    return p0, grads


def _torch_states(p0: np.ndarray, grads: list[np.ndarray], h: dict) -> list[tuple[np.ndarray, ...]]:
    param = torch.from_numpy(p0.copy()).requires_grad_(True)
    opt = torch.optim.AdamW([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], foreach=False)
    states = []
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        s = opt.state[param]
        states.append(tuple(x.detach().numpy().copy() for x in (param, s["exp_avg"], s["exp_avg_sq"])))
    return states


def _runtime_states(p0: np.ndarray, grads: list[np.ndarray], h: dict, decoupled: bool = True,
                    bias_correction: bool = True) -> list[tuple[np.ndarray, ...]]:
    """`adam.adam_ref` step after step; without bias correction it is told a step so late that 1 - beta**step
    is 1 (m and v do not depend on the step, only the two corrections do)."""
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    states = []
    for step, g in enumerate(grads, 1):
        adam.adam_ref(p, g, m, v, step=step if bias_correction else 10**9, decoupled=decoupled, **h)
        states.append((p.copy(), m.copy(), v.copy()))
    return states


def _learner_states(fn: Callable, p0: np.ndarray, grads: list[np.ndarray], h: dict) -> list[tuple[np.ndarray, ...]]:
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    states = []
    for step, g in enumerate(grads, 1):
        returned = _quietly(fn, p, g.copy(), m, v, step, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"])
        assert returned is None, (
            f"adamw_fused returned {type(returned).__name__}; it should update param, exp_avg and exp_avg_sq in "
            "place and return None (a new array would cost a pass over memory of its own)")
        states.append((p.copy(), m.copy(), v.copy()))
    return states


def _quietly(fn: Callable, *args):
    """Call the learner's function without Numba's compile-time warnings (the verdict says what matters)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaWarning)
        return fn(*args)


def _first_difference(got, want) -> tuple[int, str, int] | None:
    """(step, quantity, index) of the first disagreement of two state histories, or None."""
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True), 1):
        for index, name in ((1, "exp_avg"), (2, "exp_avg_sq"), (0, "param")):  # m and v first: p depends on them
            atol = AGREE_ATOL * float(np.abs(theirs[index]).max())
            bad = ~np.isclose(mine[index], theirs[index], rtol=AGREE_RTOL, atol=atol)
            if bad.any():
                return step, name, int(np.argmax(bad))
    return None


MISTAKES = (  # (what the learner did, how to run the runtime that way)
    ("applied weight decay the Adam way (weight_decay * p added to the gradient, so it goes through exp_avg and "
     "exp_avg_sq); AdamW decays the weight itself: p * (1 - lr * weight_decay)", {"decoupled": False}),
    ("left out the bias corrections: divide exp_avg by 1 - beta1**step and exp_avg_sq by 1 - beta2**step (the "
     "step size lr / (1 - beta1**step) and sqrt(exp_avg_sq) / sqrt(1 - beta2**step))", {"bias_correction": False}),
)


def _agreement(fn: Callable) -> None:
    for case, (h, scale) in enumerate(AGREE_CASES):
        p0, grads = _state(AGREE_N, AGREE_SEED + case, scale)
        got = _learner_states(fn, p0, grads, h)
        for ref_name, ref in (("torch AdamW", _torch_states(p0, grads, h)),
                              ("adam.adam_ref", _runtime_states(p0, grads, h))):
            where = _first_difference(got, ref)
            if where is None:
                continue
            step, name, i = where
            index = {"param": 0, "exp_avg": 1, "exp_avg_sq": 2}[name]
            detail = (f"{name} differs from {ref_name} first at step {step}, element {i} of {AGREE_N}: got "
                      f"{got[step - 1][index][i]!r}, expected {ref[step - 1][index][i]!r} "
                      f"({', '.join(f'{k}={v}' for k, v in h.items())})")
            for mistake, how in MISTAKES:
                if h["weight_decay"] == 0 and "decoupled" in how:
                    continue  # without decay the two ways agree
                if _first_difference(got, _runtime_states(p0, grads, h, **how)) is None:
                    raise AssertionError(f"{detail}: your kernel {mistake}")
            raise AssertionError(f"{detail}. Hint: in each step, p = p * (1 - lr * weight_decay); "
                                 "m = m + (1 - beta1) * (g - m); v = v * beta2 + (1 - beta2) * g * g; "
                                 "p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps), every element "
                                 "once (Tasks 3.1 and 3.2)")


def _one_thread_reason(fn: Callable) -> str | None:
    """Why a compiled kernel runs on one thread, or None (not compiled: the timing judges it)."""
    if not isinstance(fn, numba.core.registry.CPUDispatcher):
        return None
    if not fn.targetoptions.get("parallel"):
        return "it is compiled without parallel=True: write @numba.njit(parallel=True)"
    parallel_loops = [cres for cres in fn.overloads.values()  # the loops Numba turned into parallel ones
                      if getattr(cres.metadata.get("parfor_diagnostics"), "initial_parfors", None)]
    if not parallel_loops:
        return ("Numba found no loop to run in parallel: the loop uses `range`, which runs on one thread; "
                "write `for i in numba.prange(param.size)`")
    return None


def roofline_fraction(fn: Callable, num_params: int = TIME_N, rounds: int = TIME_ROUNDS) -> float:
    """Median over interleaved rounds of (roofline kernel's seconds) / (fn's seconds), on arrays of num_params."""
    rng = np.random.default_rng(0)
    param = rng.standard_normal(num_params, dtype=np.float32)
    grad = (1e-3 * rng.standard_normal(num_params, dtype=np.float32))
    exp_avg, exp_avg_sq = np.zeros_like(param), np.zeros_like(param)
    streams = [np.ones(num_params, np.float32) for _ in range(4)]

    def learner(step: int) -> float:
        start = time.perf_counter()
        _quietly(fn, param, grad, exp_avg, exp_avg_sq, step, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        return time.perf_counter() - start

    def roofline() -> float:
        start = time.perf_counter()
        hardware._seven_streams(*streams)
        return time.perf_counter() - start

    learner(1), roofline()  # warm-up: compilation, first touch of the pages, thread start
    return statistics.median(roofline() / learner(step) for step in range(2, rounds + 2))


@grader("3.5", rebuilds=(
    "minioffload.kernels.adam.adam_fused",
    "minioffload.kernels.adam.adam_fused_into",
    "minioffload.kernels.adam.adam_mixed",
    "minioffload.kernels.adam._fused_fp32",
))
def adamw_fused(fn: Callable) -> str:
    """fn(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay) -> None, in place."""
    _agreement(fn)
    reason = _one_thread_reason(fn)
    assert reason is None, f"your kernel agrees with torch AdamW but runs on one thread: {reason}"
    fraction = roofline_fraction(fn)
    assert fraction >= MIN_ROOFLINE_FRACTION, (
        f"your kernel agrees with torch AdamW but is too slow: {fraction:.2f} of the roofline (this machine's "
        f"memory bandwidth at 28 B per parameter), below {MIN_ROOFLINE_FRACTION}. One pass per NumPy operation "
        "moves several times Adam's 28 B per parameter (Task 3.4): write one loop that reads each array once, "
        "compiled with @numba.njit(parallel=True) over numba.prange")
    decays = ", ".join(str(h["weight_decay"]) for h, _ in AGREE_CASES)
    return (f"{len(AGREE_CASES)} settings x {AGREE_STEPS} steps match torch AdamW and adam.adam_ref (weight_decay "
            f"{decays}); {fraction:.2f} of the roofline at {TIME_N // 10**6}M parameters on "
            f"{numba.get_num_threads()} threads (floor {MIN_ROOFLINE_FRACTION})")
