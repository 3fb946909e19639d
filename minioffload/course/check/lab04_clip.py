"""Graders for Lab 4, Tasks 4.3 and 4.4: the clipping combine and the bytes that cross the link.

Tasks 4.1 and 4.2 (the gradient hook, the update-and-upload loop) are graded in lab04.py.
Neither grader holds the answer: the norm and the coefficient are what torch's clip_grad_norm_ returns and
applies (the coefficient measured on a probe gradient), and the bytes per step are what `OffloadAdam` moves over
the simulated device's link in one step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import nn

from ...engine.optimizer import OffloadAdam
from .grading import grader, sim_device

# ---------------------------------------------------------------------------------------------
# Task 4.3: the clipping coefficient from per-subgroup partial sums

CLIP_RTOL = 1e-6
CLIP_RANDOM_SETS = 40


def _grad_set(rng: random.Random, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return [torch.randn(rng.randint(1, 200), generator=g) * scale for _ in range(rng.randint(1, 8))]


def _split(rng: random.Random, grads: list[torch.Tensor]) -> list[float]:
    """Partial sums of squares of the gradients, cut into 1..len(grads) contiguous subgroups."""
    cuts = sorted(rng.sample(range(1, len(grads)), rng.randint(0, len(grads) - 1))) if len(grads) > 1 else []
    bounds = [0, *cuts, len(grads)]
    return [sum(float(g.double().square().sum()) for g in grads[a:b]) for a, b in zip(bounds, bounds[1:],
                                                                                    strict=False)]


def _clip_cases() -> list[tuple[str, list[torch.Tensor], float]]:
    rng = random.Random(4)
    cases = [("gradients well above max_norm", _grad_set(rng, 1.0), 0.5),
             ("gradients below max_norm (no clipping)", _grad_set(rng, 1e-2), 5.0),
             ("all-zero gradients", [torch.zeros(7), torch.zeros(3, 4).reshape(-1)], 1.0),
             ("tiny gradients, where the 1e-6 matters", _grad_set(rng, 1e-5), 1e-6)]
    for n in range(CLIP_RANDOM_SETS):
        grads = _grad_set(rng, 10 ** rng.uniform(-3, 2))
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        cases.append((f"random set {n}", grads, norm * 10 ** rng.uniform(-1.5, 1.5)))
    return cases


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=CLIP_RTOL, abs_tol=1e-12)


def torch_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor clip_grad_norm_ multiplies the gradients by, when their norm is `total_norm`: measured on one
    float64 probe gradient of that norm (one tiny enough to count as zero for a zero norm)."""
    probe = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    value = total_norm if total_norm > 0 else 1e-200  # its square underflows: torch sees a norm of 0
    probe.grad = torch.full((1,), value, dtype=torch.float64)
    nn.utils.clip_grad_norm_([probe], max_norm)
    return float(probe.grad) / value


@grader("4.3", rebuilds=("minioffload.engine.gradients.GradientPath.clip_coefficient",))
def clip_coefficient(fn: Callable) -> str:
    """fn(partial_sums_of_squares, max_norm) -> (total_norm, coefficient), as clip_grad_norm_ computes them."""
    rng = random.Random(5)
    clipped = untouched = 0
    subgroup_counts = set()
    for what, grads, max_norm in _clip_cases():
        partial = _split(rng, grads)
        subgroup_counts.add(len(partial))
        copies = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(copies, grads, strict=True):
            p.grad = g.clone()
        norm = float(nn.utils.clip_grad_norm_(copies, max_norm))
        coef = torch_coefficient(norm, max_norm)
        call = f"{what}: clip_coefficient({[float(f'{s:.4g}') for s in partial]}, max_norm={max_norm:.4g})"
        try:
            got = fn(list(partial), max_norm)
        except ZeroDivisionError:
            raise AssertionError(f"{call} divided by zero: torch divides by (total_norm + 1e-6), which also keeps "
                                 "an all-zero gradient finite") from None
        assert isinstance(got, tuple) and len(got) == 2, f"{call} returned {got!r}; expected (total_norm, coefficient)"
        got_norm, got_coef = float(got[0]), float(got[1])
        squares = sum(partial)
        if not _close(got_norm, norm):
            hint = ("that is the sum of squares: take its square root" if _close(got_norm, squares) else
                    "that adds the subgroups' norms; add their squares, then take one square root"
                    if _close(got_norm, sum(math.sqrt(s) for s in partial)) else
                    "total_norm = sqrt(sum of the partial sums)")
            raise AssertionError(f"{call}: total_norm {got_norm:.6g}, clip_grad_norm_ says {norm:.6g}: {hint}")
        if not _close(got_coef, coef):
            if got_coef > 1:
                hint = "never scale gradients up: take min(1, ...)"
            elif norm and _close(got_coef, min(1.0, max_norm / norm)):
                hint = "you left out the + 1e-6: torch divides by (total_norm + 1e-6)"
            else:
                hint = "coefficient = min(1, max_norm / (total_norm + 1e-6))"
            raise AssertionError(f"{call}: coefficient {got_coef:.6g}, clip_grad_norm_ scales by {coef:.6g}: {hint}")
        for p, g in zip(copies, grads, strict=True):  # the coefficient is what clip_grad_norm_ multiplied by
            assert torch.allclose(g * got_coef, p.grad, rtol=1e-5, atol=1e-12), f"{call}: scaled gradients differ"
        clipped, untouched = clipped + (coef < 1), untouched + (coef == 1)
    return (f"{clipped + untouched} gradient sets in {min(subgroup_counts)}-{max(subgroup_counts)} subgroups match "
            f"clip_grad_norm_ to {CLIP_RTOL:g}: {clipped} clipped, {untouched} left alone (all-zero included)")


# ---------------------------------------------------------------------------------------------
# Task 4.4: bytes over the link per step

LINK_PARAMS = (1, 1000, 124_000_000, 7_000_000_000)
LINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def engine_link_bytes(dtype: torch.dtype) -> int:
    """Bytes per parameter one step of `OffloadAdam` moves over the sim device's link (both directions, as its
    trace records them), for a small model in `dtype`."""
    g = torch.Generator().manual_seed(44)
    with torch.random.fork_rng(devices=[]):  # the learner's random state stays as it was
        model = nn.Linear(16, 8).to(dtype)
    with sim_device() as dev:
        dev.place(model)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3)
        model(torch.randn(4, 16, generator=g).to(dtype)).float().square().mean().backward()
        opt.step()
        dev.synchronize()
        moved = sum(span.nbytes for lane in ("d2h", "h2d") for span in dev.trace.on(lane))
    numel = sum(p.numel() for p in model.parameters())
    assert moved % numel == 0, f"the engine moved {moved} bytes for {numel} parameters, not a whole number each"
    return moved // numel


@grader("4.4", nothing_to_refuse="the runtime moves these bytes but no function counts them; the check measures a run")
def link_bytes_per_step(fn: Callable) -> str:
    """fn(num_params, model_dtype) -> bytes per step over the link: gradients down plus weights up."""
    measured = {dtype: engine_link_bytes(dtype) for dtype in LINK_DTYPES}
    for dtype, per_param in measured.items():
        size = torch.empty(0, dtype=dtype).element_size()
        for num_params in LINK_PARAMS:
            expected = per_param * num_params
            got = fn(num_params, dtype)
            call = f"link_bytes_per_step({num_params:_}, {dtype})"
            if isinstance(got, (int, float)) and not isinstance(got, bool) and got == expected:
                continue
            per = got / num_params if isinstance(got, (int, float)) else None
            hint = ("that counts one direction: the gradients come down and the new weights go up, both in the "
                    "model's dtype" if per == size else
                    "both directions carry the model's dtype (the fp32 master copy never leaves the host)"
                    if per is not None and per > per_param else
                    f"OffloadAdam moves {per_param} bytes per parameter of a {dtype} model in one step")
            raise AssertionError(f"{call} returned {got!r}, expected {expected:_}: {hint}")
    cases = len(LINK_DTYPES) * len(LINK_PARAMS)
    big = fn(7_000_000_000, torch.bfloat16)
    return (f"{cases} cases match: {measured[torch.bfloat16]} bytes per parameter for a 16-bit model, "
            f"{measured[torch.float32]} for fp32; a 7B bf16 model sends {big / 1e9:.0f} GB over the link every step")
