"""Grader for Lab 4's diagnosis task (4.5): an offloaded run that drifts from torch's AdamW, its cause named from the
losses and norms beside torch's, and fixed.

The learner gets a recipe (what a torch run did: AdamW, `clip_grad_norm_`, micro-batches accumulated into one step)
and the same recipe run with `OffloadAdam` on the simulated device, with the settings that run used and what it logged
beside torch's: losses per step, the norms torch's `clip_grad_norm_` measured, the norms the loop's own
`clip_grad_norm_` returned, the norms the optimizer measured. Each run carries one setting that makes it drift and one
that looks wrong but changes nothing in this run (a decoy). Three causes, two cases of each:

    clipping       the loop calls clip_grad_norm_ on the model, but OffloadAdam's hook took the gradients off the
                   parameters (all of them, or all but the few kept on the device) and the optimizer does not clip
    accumulation   the loop zeroes the gradients before each micro-batch: only the last one's gradient is stepped on
    stale          the one-step delayed update is on, and a forward ran on weights one update old

The fix is a dict of changes to the run's settings, graded by running it: the real OffloadAdam on the sim device must
then log torch's losses at every step, and end with torch's weights, to float32 rounding. More than one fix can be
right. A wrong cause fails with why it does not fit this run's numbers. Runs are deterministic (no timings), so the
verdict is the same on every machine. This is not a test of OffloadAdam: the runtime is right, the loop misuses it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from ...engine.optimizer import OffloadAdam
from .grading import grader, sim_device

CAUSES = ("clipping", "accumulation", "stale")
FIX_KEYS = ("max_grad_norm", "clip_in_loop", "zero_grad", "delay_updates_after")
ZERO_GRAD = ("each micro-batch", "each step")
LOSS_TOLERANCE = 1e-5  # a loss against torch's, at every step (float32 rounding is ~1e-7 here; a drift 1e-3 or more)
WEIGHT_TOLERANCE = 1e-5  # its final weights against torch's
STEPS = 6
GOOD = {"max_grad_norm": None, "clip_in_loop": False, "zero_grad": "each step", "delay_updates_after": None,
        "min_offload_numel": 0}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: each case's runs are cached
class Case:
    cause: str
    seed: int
    micro_batches: int
    max_norm: float
    settings: dict  # changes to GOOD (plus max_grad_norm = max_norm unless they say otherwise)
    lr: float = 1e-2


CASES = (
    Case("accumulation", 1, 4, 5.0, {"zero_grad": "each micro-batch", "clip_in_loop": True, "max_grad_norm": None}),
    Case("stale", 2, 1, 0.5, {"delay_updates_after": 1, "zero_grad": "each micro-batch"}),
    Case("clipping", 3, 2, 0.5, {"clip_in_loop": True, "max_grad_norm": None, "delay_updates_after": STEPS - 1}),
    Case("stale", 4, 2, 5.0, {"delay_updates_after": 3, "clip_in_loop": True, "max_grad_norm": None}, lr=3e-2),
    Case("clipping", 5, 1, 0.4, {"clip_in_loop": True, "max_grad_norm": None, "min_offload_numel": 100,
                                 "zero_grad": "each micro-batch"}),
    Case("accumulation", 6, 2, 0.5, {"zero_grad": "each micro-batch", "delay_updates_after": STEPS - 1}),
)

EXAMPLE = Case("clipping", 11, 1, 0.5, {"clip_in_loop": True, "max_grad_norm": None,
                                        "zero_grad": "each micro-batch"})  # the lab's worked run, not graded


def recipe_of(case: Case) -> dict:
    """The torch run the offloaded one should reproduce."""
    return {"lr": case.lr, "weight_decay": 0.01, "max_norm": case.max_norm, "micro_batches": case.micro_batches,
            "steps": STEPS}


def settings_of(case: Case) -> dict:
    return {**GOOD, "max_grad_norm": case.max_norm, **case.settings}


def _model(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # the learner's random state stays as it was
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batches(seed: int, micro_batches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(micro_batches)]
            for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> torch.Tensor:
    return (model(x) - y).square().mean() / micro_batches


@functools.cache
def _torch_run(case: Case) -> tuple[tuple[float, ...], tuple[float, ...], tuple[torch.Tensor, ...]]:
    """The recipe with torch's AdamW: (losses, norms clip_grad_norm_ measured, final weights)."""
    recipe, model = recipe_of(case), _model(case.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"], foreach=False)
    losses, norms = [], []
    for batch in _batches(case.seed, case.micro_batches):
        total = 0.0
        for x, y in batch:
            loss = _loss(model, x, y, len(batch))
            loss.backward()
            total += loss.item()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), recipe["max_norm"])))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return tuple(losses), tuple(norms), tuple(p.detach().clone() for p in model.parameters())


def _offloaded_run(case: Case, settings: dict) -> dict:
    """The recipe with OffloadAdam on the sim device, in the loop the lab shows, with these settings."""
    recipe, model = recipe_of(case), _model(case.seed)
    losses, loop_norms, optimizer_norms = [], [], []
    with sim_device() as dev:
        dev.place(model)
        opt = OffloadAdam(model.parameters(), dev, lr=recipe["lr"], weight_decay=recipe["weight_decay"],
                          subgroup_numel=4096, max_grad_norm=settings["max_grad_norm"],
                          delay_updates_after=settings["delay_updates_after"],
                          min_offload_numel=settings["min_offload_numel"])
        try:
            for batch in _batches(case.seed, case.micro_batches):
                total = 0.0
                for x, y in batch:
                    if settings["zero_grad"] == "each micro-batch":
                        opt.zero_grad()
                    loss = _loss(model, x, y, len(batch))
                    loss.backward()
                    total += loss.item()
                if settings["clip_in_loop"]:
                    loop_norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), recipe["max_norm"])))
                opt.step()
                optimizer_norms.append(opt.last_grad_norm)
                if settings["zero_grad"] == "each step":
                    opt.zero_grad()
                losses.append(total)
            opt.flush()
            opt.quiesce()
            dev.synchronize()
            weights = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
    torch_losses, torch_norms, torch_weights = _torch_run(case)
    gap = max(float((a - b).abs().max()) for a, b in zip(weights, torch_weights, strict=True))
    return {"settings": dict(settings), "losses": losses, "torch_losses": list(torch_losses),
            "torch_norms": list(torch_norms), "loop_norms": loop_norms if settings["clip_in_loop"] else None,
            "optimizer_norms": optimizer_norms, "weight_gap": gap}


@functools.cache
def _seen(case: Case) -> dict:
    return _offloaded_run(case, settings_of(case))


def run_of(case: Case) -> dict:
    """What the learner sees of one case (a fresh copy each time)."""
    seen = _seen(case)
    return {key: (list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value)
            for key, value in seen.items()}


def example() -> tuple[dict, dict]:
    """The recipe and run the lab shows before the task (a case the grader does not use)."""
    return recipe_of(EXAMPLE), run_of(EXAMPLE)


def parted_at(run: dict) -> int | None:
    """The first step whose loss differs from torch's by more than LOSS_TOLERANCE (None: none does)."""
    return next((i for i, (a, b) in enumerate(zip(run["losses"], run["torch_losses"], strict=True))
                 if abs(a - b) > LOSS_TOLERANCE), None)


def _why_not(named: str, case: Case, run: dict) -> str:
    """Why `named` is not the cause of this run's drift, from its settings and what it logged."""
    s, norms, parted = run["settings"], run["torch_norms"], parted_at(run)
    where = f"the losses part from torch's at step {parted}"
    if named == "clipping":
        if max(norms) <= case.max_norm:
            return (f"torch's clip_grad_norm_ measured norms of {min(norms):.3f} to {max(norms):.3f}, all under "
                    f"max_norm {case.max_norm:g}: it scaled no gradient, so a clip this run skipped changed nothing")
        mine = run["optimizer_norms"][0]
        if abs(mine - norms[0]) <= 1e-5 * norms[0]:
            return (f"the optimizer clips at max_norm {s['max_grad_norm']:g}, and at step 0 it measured the norm "
                    f"torch's clip_grad_norm_ did ({mine:.4f}, torch {norms[0]:.4f}): the clip is there ({where})")
        return (f"the optimizer clips at max_norm {s['max_grad_norm']:g}; at step 0 it measured a norm of {mine:.4f} "
                f"where torch's clip_grad_norm_ measured {norms[0]:.4f}: it clipped, but not the gradient torch did")
    if named == "accumulation":
        if case.micro_batches == 1:
            return ("each step has one micro-batch: there is nothing to accumulate, so zeroing the gradients before "
                    f"it drops nothing ({where})")
        return (f"the loop zeroes the gradients once per step, after opt.step(): each of the {case.micro_batches} "
                f"micro-batches' gradients is added in ({where})")
    n = s["delay_updates_after"]
    if n is None:
        return "the update is not delayed (delay_updates_after is None): every update uses its own step's gradients"
    return (f"the delayed update begins with update {n + 1}, the last of this run's {STEPS}, and flush() sends it: no "
            f"forward ran on weights it left behind (a stale update shows first in the loss at step {n + 1}; {where})")


def _check_fix(fix: dict, number: int) -> None:
    unknown = sorted(set(fix) - set(FIX_KEYS))
    assert not unknown, (f"case {number}: the fix changes {', '.join(map(repr, unknown))}; a fix may change only "
                         f"{', '.join(map(repr, FIX_KEYS))} (the recipe and the run's memory stay as they are)")
    if "zero_grad" in fix:
        assert fix["zero_grad"] in ZERO_GRAD, (
            f"case {number}: zero_grad {fix['zero_grad']!r} is not one of {', '.join(map(repr, ZERO_GRAD))}")
    if "clip_in_loop" in fix:
        assert isinstance(fix["clip_in_loop"], bool), f"case {number}: clip_in_loop is True or False"


@grader("4.5", nothing_to_refuse=(
    "no runtime function diagnoses a drifting run; the fix is graded by running OffloadAdam against torch's AdamW"
))
def diagnose(fn: Callable) -> str:
    """fn(recipe, run) -> (cause, fix), for each case."""
    for number, case in enumerate(CASES, 1):
        run = run_of(case)
        answer = fn(recipe_of(case), run)
        assert isinstance(answer, tuple) and len(answer) == 2, (
            f"case {number}: diagnose_drift returned {answer!r}; return (cause, fix), e.g. ('stale', "
            "{'delay_updates_after': None})")
        cause, fix = answer
        assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
        assert isinstance(fix, dict), f"case {number}: the fix is a {type(fix).__name__}; return a dict of changes"
        if cause != case.cause:
            raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, run_of(case))}")
        _check_fix(fix, number)
        try:
            fixed = _offloaded_run(case, {**settings_of(case), **fix})
        except ValueError as refused:  # OffloadAdam's own words for a value or a combination it refuses
            raise AssertionError(f"case {number}: OffloadAdam refused the fixed settings: {refused}") from None
        parted = parted_at(fixed)
        if parted is not None:
            raise AssertionError(
                f"case {number} ({case.cause}, rightly): with {fix} the run still parts from torch's: loss "
                f"{fixed['losses'][parted]:.6f} at step {parted} against torch's {fixed['torch_losses'][parted]:.6f}; "
                "the fix must make the offloaded run compute what torch's does")
        assert fixed["weight_gap"] <= WEIGHT_TOLERANCE, (
            f"case {number} ({case.cause}, rightly): with {fix} the losses match, but the final weights differ from "
            f"torch's by up to {fixed['weight_gap']:.1e} (at most {WEIGHT_TOLERANCE:g})")
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}) past a setting that changed nothing, and each "
            f"fixed run logs torch's losses to {LOSS_TOLERANCE:g} and ends with its weights to {WEIGHT_TOLERANCE:g}")
