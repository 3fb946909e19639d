"""Grader for Lab 3's diagnosis task (3.6): an AdamW update that drifts from torch's, its bug named from the numbers
and fixed.

The grader owns the update: AdamW in torch's order of operations on float32 tensors (so that, right, it matches
`torch.optim.AdamW(foreach=False)` bit for bit), followed by the bf16 copy of the weights that goes back to the
GPU, with four settings. Each case gets one of them wrong. Four causes, two cases of each:

    bias_step   the bias corrections use the step after the right one: every weight's early updates are scaled
                by the same factor, which fades as the steps go on; the moments are right
    eps_inside  eps is added to v inside the square root: weights whose gradients are far above sqrt(eps) move as
                torch's do, weights with small gradients move much less; the moments are right
    l2_decay    the weight decay is added to the gradient (Adam's L2) instead of shrinking the weight: the decay
                goes through both moments, which differ from torch's (only where weight_decay is not 0)
    truncation  the bf16 copy drops the low 16 bits instead of rounding to nearest even: the fp32 weights and
                the moments match torch's bit for bit, and the bf16 copy is one bf16 step toward zero in places

The learner gets the gradients of every step, and after each step the update's weights, moments and bf16 copy
beside torch's. The fix is a dict of changed settings, graded by running the update with it against torch on the
case's gradients: the fp32 state within RTOL and the bf16 copy equal at every step. More than one fix is right where
settings give the same numbers. A wrong cause fails with why it does not fit that case's numbers. Everything is
seeded arithmetic: verdicts are the same on every run.

What this is not: a grader of the learner's own Adam (Tasks 3.2 and 3.5 are graded in lab03.py, lab03_kernel.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from .grading import grader

CAUSES = ("bias_step", "eps_inside", "l2_decay", "truncation")
HEALTHY = {"bias_step": 0, "eps": "outside", "decay": "decoupled", "rounding": "nearest_even"}
CHOICES = {"eps": ("outside", "inside"), "decay": ("decoupled", "l2"), "rounding": ("nearest_even", "truncate")}
NUM_PARAMS, STEPS = 64, 6
RTOL = 1e-6  # fp32 state against torch's; the bf16 copy must be equal


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    broken: dict  # the setting that differs from HEALTHY
    seed: int
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


CASES = (
    Case("eps_inside", {"eps": "inside"}, 1, weight_decay=0.0),
    Case("l2_decay", {"decay": "l2"}, 2, weight_decay=0.1),
    Case("truncation", {"rounding": "truncate"}, 3),
    Case("bias_step", {"bias_step": 1}, 4, weight_decay=0.0),
    Case("l2_decay", {"decay": "l2"}, 5, lr=1e-2, weight_decay=0.05),
    Case("truncation", {"rounding": "truncate"}, 6, lr=1e-2, weight_decay=0.0),
    Case("eps_inside", {"eps": "inside"}, 7, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    Case("bias_step", {"bias_step": 1}, 8, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1),
)

EXAMPLE = Case("bias_step", {"bias_step": 2}, 9, betas=(0.85, 0.995))  # the lab's worked run, not graded


def _inputs(case: Case) -> tuple[np.ndarray, list[np.ndarray]]:
    """Starting weights, and gradients whose sizes span 1e-7 to 1 (random signs), fresh each step."""
    rng = np.random.default_rng(case.seed)
    p0 = rng.normal(0, 0.5, NUM_PARAMS).astype(np.float32)
    grads = [(rng.choice((-1.0, 1.0), NUM_PARAMS) * 10.0 ** rng.uniform(-7, 0, NUM_PARAMS)).astype(np.float32)
             for _ in range(STEPS)]
    return p0, grads


def _state(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, bf16: torch.Tensor) -> dict:
    return {"param": p.numpy().copy(), "exp_avg": m.numpy().copy(), "exp_avg_sq": v.numpy().copy(),
            "param_bf16": bf16.float().numpy()}


def _update(settings: dict, case: Case, p0: np.ndarray, grads: list[np.ndarray]) -> list[dict]:
    """The grader's AdamW with `settings`: the state after each step."""
    lr, (beta1, beta2), eps, wd = case.lr, case.betas, case.eps, case.weight_decay
    p = torch.from_numpy(p0.copy())
    m, v, states = torch.zeros_like(p), torch.zeros_like(p), []
    for step, grad in enumerate(grads, 1):
        g = torch.from_numpy(grad)
        if settings["decay"] == "l2":
            g = g + wd * p
        else:
            p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = step + settings["bias_step"]
        bias2 = 1 - beta2**t
        denom = (v.sqrt() / bias2**0.5).add_(eps) if settings["eps"] == "outside" else (v / bias2).add_(eps).sqrt_()
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        bf16 = p.to(torch.bfloat16) if settings["rounding"] == "nearest_even" else (
            p.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        states.append(_state(p, m, v, bf16))
    return states


def _torch(case: Case, p0: np.ndarray, grads: list[np.ndarray]) -> list[dict]:
    """torch.optim.AdamW on the same gradients, and its weights rounded to bf16."""
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([p], lr=case.lr, betas=case.betas, eps=case.eps, weight_decay=case.weight_decay,
                            foreach=False)
    states = []
    for grad in grads:
        p.grad = torch.from_numpy(grad.copy())
        opt.step()
        state = opt.state[p]
        states.append(_state(p.detach(), state["exp_avg"], state["exp_avg_sq"], p.detach().to(torch.bfloat16)))
    return states


def run_of(case: Case) -> dict:
    """What the learner sees of one case: the settings' numbers, the gradients, and both runs step by step."""
    p0, grads = _inputs(case)
    hyper = {"lr": case.lr, "beta1": case.betas[0], "beta2": case.betas[1], "eps": case.eps,
             "weight_decay": case.weight_decay}
    return {"hyper": hyper, "p0": p0, "grads": grads, "ours": _update({**HEALTHY, **case.broken}, case, p0, grads),
            "torch": _torch(case, p0, grads)}


def example() -> dict:
    """The run the lab shows before the task (a case the grader does not use)."""
    return run_of(EXAMPLE)


def _differ(run: dict, *keys: str) -> int:
    """At how many (step, weight) pairs any of `keys` differs from torch's at all."""
    return sum(int(np.sum(np.any([o[key] != t[key] for key in keys], axis=0)))
               for o, t in zip(run["ours"], run["torch"], strict=True))


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` does not fit this case's numbers."""
    pairs = f"of the {STEPS * NUM_PARAMS} (step, weight) pairs"
    moments, master = _differ(run, "exp_avg", "exp_avg_sq"), _differ(run, "param")
    if named == "truncation":
        return (f"the fp32 weights differ from torch's at {master} {pairs}: a rounding of the bf16 copy cannot "
                "change the fp32 weights it is made from")
    if case.cause == "truncation":
        return (f"the fp32 weights and both moments match torch's bit for bit at every step; only the bf16 copies "
                f"differ, at {_differ(run, 'param_bf16')} {pairs}")
    if named == "l2_decay":
        decay = " (and weight_decay is 0 here: L2 and decoupled decay are the same update)" if not \
            case.weight_decay else ""
        return (f"exp_avg and exp_avg_sq match torch's bit for bit at every step: a decay added to the gradient "
                f"would change both moments{decay}")
    if case.cause == "l2_decay":
        return (f"the moments differ from torch's at {moments} {pairs}: the bias corrections and eps act after the "
                "moments, so they cannot change them; something changed the gradient they average")
    p0, g = run["p0"], run["grads"][0]
    ours, theirs = run["ours"][0]["param"] - p0, run["torch"][0]["param"] - p0
    ratio = np.abs(ours) / np.maximum(np.abs(theirs), 1e-30)
    big, small = float(np.median(ratio[np.abs(g) > 1e-2])), float(np.median(ratio[np.abs(g) < 1e-5]))
    shape = ("every weight's by about the same factor" if case.cause == "bias_step" else
             "the small-gradient weights' far more than the others'")
    return (f"at step 1 the updates are {big:.3f} times torch's for gradients above 1e-2 and {small:.3g} for gradients "
            f"below 1e-5 (medians): {shape}, which "
            + ("a step count off by one would not do (it scales all alike)" if named == "bias_step" else
               "eps in the root would not do (it changes only gradients near sqrt(eps) or below)"))


def _apply(fix: dict, case: Case, number: int) -> dict:
    """The case's settings with the learner's changes, refused when a value is not one the update has."""
    unknown = sorted(set(fix) - set(HEALTHY))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, HEALTHY))}")
    settings = {**HEALTHY, **case.broken, **fix}
    for key, choices in CHOICES.items():
        assert settings[key] in choices, f"case {number}: {key} {settings[key]!r}: one of {choices}"
    shift = settings["bias_step"]
    assert isinstance(shift, int) and not isinstance(shift, bool) and shift >= 0, (
        f"case {number}: bias_step {shift!r}: a whole number added to the step in the bias corrections; below 0, "
        "step 1's corrections would divide by 1 - beta**0 = 0")
    return settings


def _compare(fixed: list[dict], run: dict, number: int, fix: dict) -> None:
    for step, (ours, theirs) in enumerate(zip(fixed, run["torch"], strict=True), 1):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            off = np.abs(ours[key] - theirs[key]) > RTOL * np.abs(theirs[key])
            assert not off.any(), (
                f"case {number}: with {fix}, after step {step} {key} differs from torch's at {int(off.sum())} of "
                f"{NUM_PARAMS} weights (at most {RTOL:g} relative): the update is still not torch's")
        off = ours["param_bf16"] != theirs["param_bf16"]
        assert not off.any(), (f"case {number}: with {fix}, after step {step} the bf16 copy differs from torch's "
                               f"rounding at {int(off.sum())} of {NUM_PARAMS} weights")


@grader("3.6", nothing_to_refuse=(
    "no runtime function diagnoses an Adam update; the fix is graded by running the grader's own update with it"
))
def diagnose(fn: Callable) -> str:
    """fn(run) -> (cause, fix), for each case."""
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(dict(run, hyper=dict(run["hyper"])))
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_adam returned {answer!r}; return (cause, fix), e.g. ('truncation', "
            "{'rounding': 'nearest_even'})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run)}")
        p0, grads = _inputs(case)
        _compare(_update(_apply(fix, case, number), case, p0, grads), run, number, fix)
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each fix matched torch's AdamW for "
            f"{STEPS} steps ({RTOL:g} relative, the bf16 copy exactly)")
