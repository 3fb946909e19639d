"""Graders for Lab 8, "Streaming weights": fetching and releasing a block's weights with their events (8.1), the
prefetch queue (8.2), and the streaming budget (8.3).

Task 8.1's grader, which streams a GPT's blocks through the learner's functions on the strict sim, is in
lab08_fetch.py.

Task 8.2 compares the learner's queue with `ParamStreamer.upcoming()` itself, given the same recorded order,
position and depth, over sequential and random orders; then runs `ParamStreamer` on a GPT on the sim and checks that
the queue at the end of a forward names the blocks the runtime keeps on the device for the backward. Task 8.3
builds models with the given block sizes and asks `ParamStreamer` itself: its `window_bytes`, and whether it refuses
a budget. So this file holds none of the tasks' answers. Verdicts carry counts and sizes, never timings.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import torch
from torch import nn

from ...model.gpt import GPT, GPTConfig
from ...model.streaming import ParamStreamer
from .grading import grader, sim_device

VOCAB, SEQ, BATCH = 40, 32, 4
JITTER = 2e-4  # s: each stream op is delayed by a random 0..JITTER


def _gpt(n_layer: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=32))


def _batch(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def sequential_order(n_blocks: int) -> list[tuple[bool, int]]:
    """The uses of a model whose blocks run one after another: each forward, then each backward in reverse."""
    return [(False, i) for i in range(n_blocks)] + [(True, i) for i in reversed(range(n_blocks))]


class _Sized(nn.Module):
    """A block that holds `nbytes` of weights (fp32 when it divides by 4, else bf16)."""

    def __init__(self, nbytes: int):
        super().__init__()
        dtype = torch.float32 if nbytes % 4 == 0 else torch.bfloat16
        numel = nbytes // (4 if dtype == torch.float32 else 2)
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))


class _Stack(nn.Module):
    def __init__(self, block_bytes: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(_Sized(b) for b in block_bytes)


# ---------------------------------------------------------------------------------------------
# Task 8.2: the prefetch queue

RANDOM_ORDERS = 12
KEPT_RUNS = tuple((n, k) for n in (1, 2, 4) for k in (0, 1, 2, 3, 5, 9))


def _orders() -> list[list[tuple[bool, int]]]:
    rng = random.Random(82)
    orders = [sequential_order(n) for n in range(1, 6)]
    orders += [[(rng.random() < 0.5, rng.randrange(6)) for _ in range(rng.randint(1, 10))]
               for _ in range(RANDOM_ORDERS)]
    return orders


class _Queue:
    """A ParamStreamer on a one-block model, whose recorded order, position and depth are set to ask its upcoming()."""

    def __init__(self, dev):
        self._streamer = ParamStreamer(_Stack([4]), dev, prefetch=0)

    def upcoming(self, order: list[tuple[bool, int]], pos: int, prefetch: int) -> list[int]:
        self._streamer.order, self._streamer._pos, self._streamer.prefetch = list(order), pos, prefetch
        return self._streamer.upcoming()


def _blocks_of(got, call: str) -> list[int]:
    try:
        if isinstance(got, (str, bytes, dict, set)):
            raise TypeError  # not a list of indices, or in no order
        items = list(got)
    except TypeError:
        raise AssertionError(f"{call} returned {got!r:.80}; expected a list of block indices") from None
    if any(isinstance(item, tuple) for item in items):
        raise AssertionError(f"{call} returned {items!r:.80}: uses (backward?, block), where the runtime lists "
                             "block indices, the second item of each use")
    try:
        return [int(item) for item in items]
    except (TypeError, ValueError):
        raise AssertionError(f"{call} returned {items!r:.80}; expected a list of block indices (ints)") from None


def _queue_hint(runtime: _Queue, order: list, pos: int, prefetch: int, got: list[int], want: list[int]) -> str:
    if len(got) > len(order):
        return (f"{len(got)} entries from an order of {len(order)} uses: the queue looks at most one pass ahead, "
                "never more entries than the order has uses")
    if len(got) < len(want) and got == want[:len(got)] and len(got) == max(len(order) - pos, 0):
        return ("the queue stopped at the end of the recorded order: it goes on with the next pass, from the "
                "order's first use")
    if got == list(dict.fromkeys(want)):
        return "a block used twice within the window is listed twice: one entry per use, as the runtime does"
    if len(got) < len(want) and got == want[:len(got)]:
        return f"prefetch={prefetch} asks for the next {prefetch} uses"
    if sorted(got) == sorted(want):
        return "the right blocks in the wrong order: list them in the order of their uses"
    if got == runtime.upcoming(order, pos + 1, prefetch):
        return f"order[pos] (here {order[pos % len(order)]}) is the next use: the queue starts with it"
    if got == runtime.upcoming(order, pos - 1, prefetch):
        return "pos counts the uses already made: order[pos - 1] is the one running now, not one to prefetch"
    return f"the next {prefetch} uses from order[{pos}] name blocks {want}"


def _kept_after_forward(n_blocks: int, prefetch: int) -> tuple[list[int], list, int]:
    """Run ParamStreamer on an n-block GPT for a pass (it records the order), then a forward: the blocks on the
    device at the end of that forward, with the order and position it has reached."""
    model = _gpt(n_blocks)
    x, y = _batch()
    with sim_device(strict=True) as dev:
        streamer = ParamStreamer(model, dev, prefetch=prefetch)
        model(x, y)[1].backward()
        loss = model(x, y)[1]
        kept = [block.index for block in streamer.blocks if block.state != "home"]
        order, pos = list(streamer.order or []), streamer._pos
        loss.backward()
        dev.synchronize()
    return kept, order, pos


@grader("8.2", rebuilds=("minioffload.model.streaming.ParamStreamer.upcoming",))
def prefetch_queue(fn: Callable) -> str:
    """fn(order, pos, prefetch) -> the blocks of the next `prefetch` uses from order[pos], as upcoming() lists them."""
    cases = 0
    with sim_device(strict=True) as dev:
        runtime = _Queue(dev)
        for order in _orders():
            n = len(order)
            for pos in range(n + 1):
                for prefetch in sorted({0, 1, 2, 3, n - 1, n, n + 1, 2 * n + 1}):
                    call = f"upcoming({order}, pos={pos}, prefetch={prefetch})"
                    got = _blocks_of(fn(list(order), pos, prefetch), call)
                    want = runtime.upcoming(order, pos, prefetch)
                    if got != want:
                        raise AssertionError(f"{call} returned {got}, but ParamStreamer.upcoming() gives {want}: "
                                             f"{_queue_hint(runtime, order, pos, prefetch, got, want)}")
                    cases += 1
    for n_blocks, prefetch in KEPT_RUNS:
        kept, order, pos = _kept_after_forward(n_blocks, prefetch)
        call = f"upcoming({order}, pos={pos}, prefetch={prefetch})"
        got = sorted(set(_blocks_of(fn(list(order), pos, prefetch), call)))
        if got != kept:
            raise AssertionError(f"after the forward of a {n_blocks}-block GPT at prefetch={prefetch}, the runtime "
                                 f"keeps blocks {kept} on the device for the backward, but {call} names {got}")
    return (f"{cases} cases ({len(_orders())} recorded orders, every position, depths 0 to past a pass) match "
            f"ParamStreamer.upcoming(); after a forward of a GPT of 1-4 blocks at prefetch 0-9 ({len(KEPT_RUNS)} "
            "runs on the sim), your queue names exactly the blocks the runtime keeps for the backward")


# ---------------------------------------------------------------------------------------------
# Task 8.3: the streaming budget

FIXED_SIZES = (
    ([1000], 0), ([1000], 3),
    ([400, 400, 400, 400], 1), ([400, 400, 400, 400], 2), ([400, 400, 400, 400], 7),
    ([100, 100, 900, 100, 100], 1),
    ([900, 10, 10, 10, 800, 200], 2),
    ([10, 20, 30, 40], 0), ([40, 30, 20, 10], 1), ([6, 2000, 6, 6, 2000, 6], 3),
)
RANDOM_SIZES = 14
GPT_CASES = ((1, 0), (2, 1), (3, 1), (3, 2), (3, 5))


def _size_cases() -> list[tuple[list[int], int, str]]:
    """(block bytes, prefetch, what it is) for models of uneven blocks, and for small GPTs."""
    rng = random.Random(83)
    cases = [(list(sizes), k, "uneven blocks") for sizes, k in FIXED_SIZES]
    for _ in range(RANDOM_SIZES):
        n = rng.randint(1, 7)
        cases.append(([2 * rng.randint(1, 2000) for _ in range(n)], rng.randint(0, n + 1), "uneven blocks"))
    for n_layer, k in GPT_CASES:
        sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in _gpt(n_layer).blocks]
        cases.append((sizes, k, f"a {n_layer}-block GPT"))
    return cases


def _model(sizes: list[int], what: str) -> nn.Module:
    return _gpt(len(sizes)) if what.endswith("GPT") else _Stack(sizes)


def _runtime_budget(dev, sizes: list[int], prefetch: int, what: str) -> tuple[int, str]:
    """ParamStreamer's own window for these blocks, and the blocks it names when a budget is one byte short."""
    window = ParamStreamer(_model(sizes, what), dev, prefetch=prefetch).window_bytes
    try:
        ParamStreamer(_model(sizes, what), dev, prefetch=prefetch, budget_bytes=window - 1)
    except ValueError as err:
        found = re.search(r"blocks \d+\.\.\d+", str(err))
        return window, found[0] if found else "the largest window"
    return window, "the largest window"


def _runtime_refuses(dev, sizes: list[int], prefetch: int, budget: int, what: str) -> bool:
    try:
        ParamStreamer(_model(sizes, what), dev, prefetch=prefetch, budget_bytes=budget)
    except ValueError:
        return True
    return False


def _names(message: str, number: int) -> bool:
    return f"{number:,}" in message or str(number) in message


def _window_hint(sizes: list[int], prefetch: int, got, window: int, blocks: str) -> str:
    where = f"{blocks} need {window:,} bytes together"
    if got == max(sizes) * (prefetch + 1) and got != window:
        return f"{where}: a window holds the blocks themselves, not copies of the largest one"
    if got == sum(sizes[:prefetch + 1]) and got != window:
        return f"{where}: the largest window may start at any block, not only at the first"
    if got < window:
        return (f"{where}, more than {got:,}: a block and the next {prefetch} after it are on the device at once, "
                f"{prefetch + 1} block{'s' if prefetch else ''} in a window (fewer only at the end of the stack)")
    return (f"{where}, less than {got:,}: windows end at the last block (the runtime does not count past it), "
            "and a window holds each block once")


@grader("8.3", rebuilds=("minioffload.model.streamed_blocks.plan",))
def streaming_budget(fn: Callable) -> str:
    """fn() -> (smallest_budget, check_budget): smallest_budget(block_bytes, prefetch) -> bytes, and
    check_budget(block_bytes, prefetch, budget_bytes) raising ValueError, naming the numbers, when it is too small."""
    functions = fn()
    if not (isinstance(functions, (tuple, list)) and len(functions) == 2 and all(map(callable, functions))):
        raise AssertionError(f"expected (smallest_budget, check_budget), got {functions!r:.80}")
    smallest_budget, check_budget = functions
    cases = _size_cases()
    budgets = refused = 0
    with sim_device(strict=True) as dev:
        for sizes, prefetch, what in cases:
            window, blocks = _runtime_budget(dev, sizes, prefetch, what)
            got = smallest_budget(list(sizes), prefetch)
            if got != window:
                raise AssertionError(f"smallest_budget({sizes}, prefetch={prefetch}) ({what}) returned {got!r:.40}; "
                                     f"ParamStreamer's window is {window:,}: "
                                     f"{_window_hint(sizes, prefetch, got, window, blocks)}")
            for budget in sorted({window - 1, window, window + 1, max(window // 2, 1), 3 * window} - {0}):
                call = f"check_budget({sizes}, prefetch={prefetch}, budget_bytes={budget:,})"
                want = _runtime_refuses(dev, sizes, prefetch, budget, what)
                try:
                    returned = check_budget(list(sizes), prefetch, budget)
                except ValueError as err:
                    message = str(err)
                    if not want:
                        equal = " (equal included: a budget of exactly the window fits)" if budget == window else ""
                        raise AssertionError(f"{call} raised ValueError, but ParamStreamer accepts that budget{equal}: "
                                             f"{blocks} need {window:,} bytes") from None
                    if not (_names(message, budget) and _names(message, window)):
                        raise AssertionError(
                            f"{call} raised ValueError({message!r:.120}): name the numbers, the budget ({budget:,}) "
                            f"and the bytes the largest window needs ({window:,}), so the reader knows how far to "
                            "raise it") from None
                    refused += 1
                except Exception as err:
                    raise AssertionError(f"{call} raised {type(err).__name__}: {err}; ParamStreamer refuses a budget "
                                         "with ValueError, and so should check_budget") from None
                else:
                    if want:
                        instead = f" (it returned {returned!r:.40} instead of raising)" if returned is not None else ""
                        raise AssertionError(f"{call} accepted a budget ParamStreamer refuses{instead}: {blocks} "
                                             f"need {window:,} bytes at prefetch={prefetch}")
                budgets += 1
    return (f"{len(cases)} stacks of blocks (uneven sizes, prefetch 0 to past the last block, and small GPTs): "
            f"smallest_budget equals ParamStreamer's window, and check_budget refuses the {refused} of {budgets} "
            "budgets the runtime refuses, naming the budget and the window")
