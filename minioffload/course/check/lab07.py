"""Graders for Lab 7, "Activations": saved-tensor hooks that send a block's activations to the host and bring them
back with events (7.1), the order in which the runtime brings offloaded blocks back (7.2), and the choice of a policy
from the cost model (7.3).

Task 7.1's grader, which watches the learner's hooks on the strict sim, is in lab07_hooks.py.

Task 7.2 runs `Activations` itself on the sim for random lists of policies and records which block each non-empty
`_fetch` brings back and during which block's backward: the learner's plan must be that record. Task 7.3 compares
with `activation_cost.best_policy` over the hardware presets, a range of block shapes and budgets. So this file holds
none of the tasks' answers. Verdicts carry counts and sizes, never timings, so they are the same on every run.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from ...machine import profiles
from ...model.activations import POLICIES, Activations
from ...model.gpt import GPT, GPTConfig
from ...predict.activation_cost import BlockShape, best_policy, policy_costs
from .grading import grader, sim_device

MIN_NUMEL = 1024  # saved tensors smaller than this stay on the device (the runtime's default min_numel)
VOCAB, SEQ, BATCH = 40, 32, 4
JITTER = 2e-4  # s: each stream op is delayed by a random 0..JITTER


def _gpt(n_layer: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=32))


def _batch(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# Task 7.2: the order in which offloaded blocks come back

FIXED_PLANS = (
    ["keep", "keep", "keep"],
    ["offload"],
    ["offload"] * 4,
    ["offload", "keep", "offload"],
    ["offload", "offload_input", "recompute", "offload"],
    ["selective", "offload", "offload", "keep"],
)
RANDOM_PLANS = 12


def _plans() -> list[list[str]]:
    rng = random.Random(72)
    plans = [list(p) for p in FIXED_PLANS]
    plans += [[rng.choice(POLICIES) for _ in range(rng.randint(1, 6))] for _ in range(RANDOM_PLANS)]
    return plans


def _runtime_fetches(policies: list[str]) -> list[tuple[int, int]]:
    """(block in backward, block fetched) for every _fetch that brought tensors back, in the order issued."""
    model = _gpt(len(policies))
    with sim_device(strict=True) as dev:
        dev.place(model)
        acts = Activations(model.blocks, policies, dev)
        seen, now = [], [None]
        unpack, fetch = acts._unpack, acts._fetch

        def watched_unpack(index, packed):
            now[0] = index
            return unpack(index, packed)

        def watched_fetch(index):
            if acts._waiting.get(index):
                seen.append((now[0], index))
            fetch(index)

        acts._unpack, acts._fetch = watched_unpack, watched_fetch
        _, loss = model(*_batch())
        loss.backward()
        dev.synchronize()
        acts.remove()
    return seen


def _plan_hint(policies: list[str], got: list, want: list[tuple[int, int]]) -> str:
    if any(not 0 <= i < len(policies) for pair in got for i in pair):
        return f"block indices run from 0 to {len(policies) - 1}"
    moved = ("offload", "offload_input")
    if any(p == "offload_input" for p in policies) and all(policies[f] != "offload_input" for _, f in got):
        return "offload_input blocks send their input to the host through the same hooks: they come back the same way"
    if any(d == f for d, f in want) and not any(d == f for d, f in got):
        return ("the first offloaded block in backward order was fetched by nothing ahead of it: its own first unpack "
                "fetches it, a pair (i, i)")
    if any(policies[d] not in moved for d, _ in got):
        return ("a block that keeps or recomputes unpacks nothing from the host, so nothing is fetched during its "
                "backward")
    if any(f < d - 1 for d, f in got):
        return ("the runtime prefetches only block i-1 during block i's backward; an offloaded block further down "
                "comes back on demand when its own backward starts")
    if sorted(got) == sorted(want):
        return "the right pairs in the wrong order: backward runs from the last block to the first"
    return "only offloaded blocks come back, each once"


@grader("7.2", rebuilds=("minioffload.model.activations.Activations._fetch",))
def fetch_order(fn: Callable) -> str:
    """fn(policies) -> [(during, fetched), ...]: the runtime's fetches of offloaded blocks, in backward order."""
    plans = _plans()
    pairs = 0
    for policies in plans:
        got = fn(list(policies))
        try:
            got = [tuple(int(v) for v in pair) for pair in got]
            assert all(len(pair) == 2 for pair in got)
        except (TypeError, ValueError, AssertionError):
            raise AssertionError(f"fetch_plan({policies}) returned {got!r:.80}; expected a list of pairs "
                                 "(during, fetched) of block indices") from None
        want = _runtime_fetches(policies)
        if got != want:
            raise AssertionError(f"fetch_plan({policies}) returned {got}, but the runtime fetched {want}: "
                                 f"{_plan_hint(policies, got, want)}")
        pairs += len(want)
    return (f"{len(plans)} lists of policies (1-6 blocks), {pairs} fetches: the same order as Activations' own "
            "_fetch calls on the sim")


# ---------------------------------------------------------------------------------------------
# Task 7.3: the policy the cost model picks

PRESETS = ("h100-sxm", "gh200", "a100-pcie")
SHAPES = tuple(BlockShape(seq_len=s, batch_size=b, hidden=h, heads=h // 128, fused_attention=fused)
               for s in (512, 2048, 8192) for b in (1, 8) for h in (1024, 4096, 8192) for fused in (True, False))


def _tied(costs: dict) -> dict:
    """The costs with offload_input adding exactly recompute's time, as it would if its hooks and its copy's issue
    were free: on the presets every saved tensor costs a little, so no two policies tie there."""
    return {**costs, "offload_input": dataclasses.replace(costs["offload_input"], extra_s=costs["recompute"].extra_s)}


def _fastest(costs: dict, budget: float) -> str | None:
    best = best_policy(None, None, budget, costs=costs)
    return best.policy if best else None


def _budgets(costs: dict) -> list[float]:
    sizes = sorted({c.device_bytes for c in costs.values()})
    return [*sizes, *(s - 1 for s in sizes if s), *(s + 1 for s in sizes), 2 ** 50, -1, -(2 ** 20)]


def _choice_hint(costs: dict, budget: float, got, want) -> str:
    if want is None:
        return "no policy's device_bytes fit a budget below zero: return None"
    if got is None:
        return "a policy fits (device_bytes <= budget, equal included): return the fastest of those"
    if got not in costs:
        return f"return the policy's name ({want!r}), not {type(got).__name__}"
    mine, best = costs[got], costs[want]
    if mine.device_bytes > budget:
        return f"{got} holds {mine.device_bytes:,} bytes, over the budget: only policies that fit count"
    if mine.extra_s == best.extra_s:
        return (f"{got} and {want} add the same time; on a tie take the one that holds less device memory "
                f"({best.device_bytes:,} bytes)")
    return f"{want} adds less time ({best.extra_s * 1e3:.4g} ms) than {got} ({mine.extra_s * 1e3:.4g} ms)"


@grader("7.3", rebuilds=("minioffload.predict.activation_cost.best_policy",))
def choose_policy(fn: Callable) -> str:
    """fn(costs, budget) -> the name of the fastest policy that fits (ties: less memory), or None."""
    cases = nothing = 0
    for name in PRESETS:
        hw = profiles.preset(name)
        for block in SHAPES:
            costs = policy_costs(block, hw)
            for budget in _budgets(costs):
                want = best_policy(block, hw, budget)
                for tied, costs_given, expected in ((False, costs, want.policy if want is not None else None),
                                                    (True, _tied(costs), _fastest(_tied(costs), budget))):
                    got = fn(dict(costs_given), budget)
                    if got != expected:
                        hint = _choice_hint(costs_given, budget, got, expected)
                        raise AssertionError(
                            f"{name}{' (offload_input tied with recompute)' if tied else ''}, {block.seq_len} tokens "
                            f"x {block.batch_size}, hidden {block.hidden}, budget {budget:,} bytes: got {got!r:.40}, "
                            f"expected {expected!r}: {hint}")
                    cases += 1
                    nothing += expected is None
    return (f"{cases} cases ({len(PRESETS)} presets x {len(SHAPES)} block shapes x budgets at each policy's size, "
            f"{nothing} where nothing fits; each also with offload_input tied with recompute) match "
            "activation_cost.best_policy")
