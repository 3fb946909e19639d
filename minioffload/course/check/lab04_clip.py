"""Graders for Lab 4, Tasks 4.3 and 4.4: the clipping combine and the bytes that cross the link.

Tasks 4.1 and 4.2 (the gradient hook, the update-and-upload loop) are graded in lab04.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import nn

from . import grader

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


@grader("4.3")
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
        coef = min(1.0, max_norm / (norm + 1e-6))
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


@grader("4.4")
def link_bytes_per_step(fn: Callable) -> str:
    """fn(num_params, model_dtype) -> bytes per step over the link: gradients down plus weights up."""
    for dtype in LINK_DTYPES:
        size = torch.empty(0, dtype=dtype).element_size()
        for num_params in LINK_PARAMS:
            expected = 2 * size * num_params
            got = fn(num_params, dtype)
            call = f"link_bytes_per_step({num_params:_}, {dtype})"
            if isinstance(got, (int, float)) and not isinstance(got, bool) and got == expected:
                continue
            per = got / num_params if isinstance(got, (int, float)) else None
            hint = ("that counts one direction: the gradients come down and the new weights go up, both in the "
                    "model's dtype" if per == size else
                    "both directions carry the model's dtype (the fp32 master copy never leaves the host)"
                    if per is not None and per > 2 * size else f"expected {2 * size} bytes per parameter")
            raise AssertionError(f"{call} returned {got!r}, expected {expected:_}: {hint}")
    cases = len(LINK_DTYPES) * len(LINK_PARAMS)
    big = fn(7_000_000_000, torch.bfloat16)
    return (f"{cases} cases match: 4 bytes per parameter for a 16-bit model, 8 for fp32; a 7B bf16 model sends "
            f"{big / 1e9:.0f} GB over the link every step")
