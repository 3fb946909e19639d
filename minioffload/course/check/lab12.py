"""Graders for Lab 12, "Past host memory for everything": the bytes one optimizer step moves over the drive, per kind of
state (12.1), and the placement that moves the fewest within a host budget (12.2).

Task 12.3 (a run refused by its host budget) is graded in lab12_diagnose.py; the package's __init__ imports both.

Task 12.1 is graded against the runtime's own pieces, over every allowed placement of the weights, the optimizer state
and the gradients, for several models, micro-batch counts and prefetch depths: the blocks fetched in a micro-batch are
the planner's `streamed_fetches` (the streamer keeps the last (prefetch + 1) // 2 blocks from their forward into their
backward); the state read and written is the NVMe tier's `STATE_BYTES_PER_PARAM`; gradients on the drive cost a
write of the fp32 sum per micro-batch and a read per micro-batch (the partial sum read back, the update's read). These
are the counts a run of the runtime moves (its trace's nvme_read and nvme_write spans), which the lab's tests compare.
A wrong count fails with the kind, the direction and, where it equals a plausible mistake, that mistake's name.
Gradients on the drive with the state in host memory must be refused with a ValueError that says to put the state
on NVMe.

Task 12.2 is graded against a search over the allowed placements, with the host bytes of `memory.streamed_bytes` and
the drive seconds of the counts above, over a grid of host budgets made of every placement's own host bytes (a budget
equal to them fits), one byte less, nothing (no placement fits: None) and plenty.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ...layout import STATE_BYTES_PER_PARAM
from ...machine import profiles
from ...planner.search import streamed_fetches
from ...predict import memory
from ...predict.shapes import ModelSpec
from .grading import grader

KINDS = ("weights", "state", "grads")
TIERS = ("host", "nvme")
MODEL_BYTES = 2  # bf16 weights and their gradients' staging
GRAD_BYTES = 4  # the fp32 sum of a subgroup's gradients


def placements() -> list[dict[str, str]]:
    """Every placement of the three kinds, in the lab's order (weights, state, grads; host before nvme)."""
    return [dict(zip(KINDS, tiers, strict=True)) for tiers in itertools.product(TIERS, repeat=3)]


def allowed(placement: dict[str, str]) -> bool:
    return not (placement["grads"] == "nvme" and placement["state"] == "host")


def expected(model: ModelSpec, placement: dict[str, str], micro_batches: int, prefetch: int = 1
             ) -> dict[str, tuple[int, int]]:
    """What the runtime moves over the drive in one step: {kind: (bytes read, bytes written)}."""
    params, blocks = model.num_params, model.n_layer * model.block_params
    traffic = dict.fromkeys(KINDS, (0, 0))
    if placement["weights"] == "nvme":
        fetched = micro_batches * streamed_fetches(model.n_layer, prefetch) * model.block_params
        traffic["weights"] = (fetched * MODEL_BYTES, blocks * MODEL_BYTES)
    if placement["state"] == "nvme":
        traffic["state"] = (STATE_BYTES_PER_PARAM * params, STATE_BYTES_PER_PARAM * params)
    if placement["grads"] == "nvme":
        traffic["grads"] = (GRAD_BYTES * micro_batches * params, GRAD_BYTES * micro_batches * params)
    return traffic


def drive_seconds(traffic: dict[str, tuple[int, int]], hw: profiles.Hardware) -> float:
    """Reads and writes share one drive: their times add."""
    return sum(r for r, _ in traffic.values()) / hw.nvme_read + sum(w for _, w in traffic.values()) / hw.nvme_write


def host_bytes(model: ModelSpec, placement: dict[str, str]) -> int:
    """Pinned host bytes of a placement, as the calculator counts them (the lab's definition)."""
    state_on_drive = placement["state"] == "nvme"
    counted = memory.streamed_bytes(model.num_params, model.n_layer, resident_params=model.resident_params,
                                    nvme=state_on_drive, params_on=placement["weights"], grads_on=placement["grads"])
    return counted["host"]


def _models() -> list[ModelSpec]:
    return [ModelSpec(2, 64, 4, 65, 32), ModelSpec(24, 128, 4, 65, 32), ModelSpec(5, 256, 8, 1000, 128),
            ModelSpec.of_params(1.3e9), ModelSpec.of_params(13e9), ModelSpec.of_params(175e9)]


def _shown(placement: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in placement.items()) + "}"


def _hint(kind: str, way: int, got: int, model: ModelSpec, m: int, prefetch: int, want: int) -> str:
    """The plausible mistake `got` equals, or how the count is made."""
    params, block, layers = model.num_params, model.block_params, model.n_layer
    if kind == "weights" and way == 0:
        known = {m * 2 * layers * block * MODEL_BYTES: (
                    "every block counted twice per micro-batch: the streamer keeps the last (prefetch + 1) // 2 blocks "
                    "from their forward into their backward (the next uses need them), so they are not read again"),
                 streamed_fetches(layers, prefetch) * block * MODEL_BYTES: (
                    "that is one micro-batch's fetches: each micro-batch runs its own forward and backward and fetches "
                    "the blocks again"),
                 m * streamed_fetches(layers, prefetch) * params // layers * MODEL_BYTES: (
                    "the resident parameters (embeddings, the final norm) stay on the device: only the blocks are "
                    "streamed (model.block_params each)"),
                 m * 2 * params * MODEL_BYTES: (
                    "the resident parameters are never streamed, and the last blocks are kept from forward into "
                    "backward")}
        return known.get(got, "per micro-batch, the blocks fetched in forward and backward (the last (prefetch + 1) "
                              "// 2 kept between them), each model.block_params x 2 bytes")
    if kind == "weights":
        known = {params * MODEL_BYTES: ("the resident parameters stay on the device: only the blocks' weights go "
                                        "home to the drive"),
                 m * layers * block * MODEL_BYTES: "the new weights are written once a step, after the update",
                 layers * block * 4: "the weights go home rounded to bf16, 2 bytes each, not as the fp32 master"}
        return known.get(got, "each block's new weights, in bf16, written home once a step")
    if kind == "state":
        known = {(STATE_BYTES_PER_PARAM + GRAD_BYTES) * params: (
                    "the gradient read beside the state belongs to the grads' count, not the state's"),
                 2 * STATE_BYTES_PER_PARAM * params: (
                    "the previous version kept on the drive is space, not traffic: a step writes each subgroup's "
                    "new state once"),
                 m * STATE_BYTES_PER_PARAM * params: "the state is read and written once a step, whatever the "
                                                     "micro-batches"}
        return known.get(got, "fp32 master weights and two moments: 12 bytes a parameter, read and written once a step")
    known = {MODEL_BYTES * m * params: "the gradients on the drive are fp32 sums, 4 bytes a parameter",
             GRAD_BYTES * params: ("that is one micro-batch's: each micro-batch writes its subgroups' partial sums, "
                                   "and reads them back first after the first micro-batch; the update reads the final "
                                   "one")}
    if way == 0:
        known.update({GRAD_BYTES * (m - 1) * params: "the update reads each subgroup's final gradient too, beside its "
                                                     "state",
                      GRAD_BYTES * (m + 1) * params: "a partial sum is read back only by the micro-batches after the "
                                                     "first"})
    return known.get(got, "per micro-batch a write of the fp32 sums (4 B a parameter); reads: the sums read back by "
                          "each micro-batch after the first, then the update's read")


def _check_refusal(fn: Callable) -> None:
    model, placement = ModelSpec(2, 64, 4, 65, 32), {"weights": "nvme", "state": "host", "grads": "nvme"}
    call = f"drive_traffic(<a {model.num_params:,}-param model>, {_shown(placement)}, 2)"
    try:
        got = fn(model, dict(placement), 2)
    except ValueError as err:
        said = str(err).lower()
        if "state" not in said or "nvme" not in said:
            raise AssertionError(f"{call} raised ValueError({str(err)!r:.120}), which does not say the fix: the "
                                 "gradients wait on the NVMe tier beside the state, so say to put the state on "
                                 "'nvme' (or the gradients on 'host')") from None
        return
    raise AssertionError(f"{call} returned {got!r:.80}; the runtime refuses gradients on the drive with the state in "
                         "host memory (they are read with the state, by the NVMe tier): raise a ValueError that says "
                         "to put the state on 'nvme'")


@grader("12.1", rebuilds=("minioffload.planner.search.streamed_fetches", "minioffload.predict.stepmodel.predict"))
def drive_traffic(fn: Callable) -> str:
    """fn(model, placement, micro_batches, prefetch=1) -> {kind: (bytes read, bytes written)} for one step."""
    cases = 0
    for model, placement, m, prefetch in itertools.product(_models(), placements(), (1, 2, 3, 8), (1, 0, 2, 3)):
        if not allowed(placement):
            continue
        given = dict(placement)
        got = fn(model, given, m) if prefetch == 1 else fn(model, given, m, prefetch)
        call = (f"drive_traffic(<a {model.num_params:,}-param model of {model.n_layer} blocks>, {_shown(placement)}, "
                f"{m}" + (f", prefetch={prefetch})" if prefetch != 1 else ")"))
        if given != placement:
            raise AssertionError(f"{call} changed the placement it was given: leave the caller's dict as it is")
        if not isinstance(got, dict) or set(got) != set(KINDS) or not all(
                isinstance(v, (tuple, list)) and len(v) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in v) for v in got.values()):
            raise AssertionError(f"{call} returned {got!r:.100}; expected {{'weights': (read, written), "
                                 "'state': (...), 'grads': (...)}, bytes as ints, (0, 0) for a kind that lives in "
                                 "host memory")
        want = expected(model, placement, m, prefetch)
        for kind in KINDS:
            for way, what in ((1, "written"), (0, "read")):  # written first: a write is made once per step
                if got[kind][way] != want[kind][way]:
                    if placement[kind] == "host":
                        hint = (f"the {kind} live in host memory here: they move nothing over the drive (0, 0)")
                    else:
                        hint = _hint(kind, way, got[kind][way], model, m, prefetch, want[kind][way])
                    raise AssertionError(f"{call}: the {kind}' bytes {what} are {got[kind][way]:,}; expected "
                                         f"{want[kind][way]:,}: {hint}")
        cases += 1
    _check_refusal(fn)
    return (f"{cases} steps ({len(_models())} models up to 175B, the 6 allowed placements, 1 to 8 micro-batches, "
            "prefetch 0 to 3): each kind's bytes read and written as the runtime moves them; gradients on the drive "
            "with the state in host memory refused")


# ---------------------------------------------------------------------------------------------
# Task 12.2: the placement with the least drive time that fits a host budget


def _budgets(model: ModelSpec) -> list[int]:
    sizes = sorted({host_bytes(model, p) for p in placements() if allowed(p)})
    return [sizes[0] // 2, *sizes, *(s - 1 for s in sizes[1:]), 4 * sizes[-1]]


def best(model: ModelSpec, budget: int, hw: profiles.Hardware, micro_batches: int) -> dict[str, str] | None:
    """The grader's search: least drive seconds, then fewest host bytes, then the lab's order."""
    fitting = [(drive_seconds(expected(model, p, micro_batches), hw), host_bytes(model, p), n, p)
               for n, p in enumerate(placements()) if allowed(p) and host_bytes(model, p) <= budget]
    return min(fitting, key=lambda row: row[:3])[3] if fitting else None


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


@grader("12.2", nothing_to_refuse=(
    "a design: the runtime's planner picks by whole-step time over many more settings; no function picks a placement "
    "by drive time within a host budget"))
def choose_placement(fn: Callable) -> str:
    """fn(model, host_budget, hw, micro_batches) -> the placement dict, or None when none fits."""
    cases = 0
    for size, name, m in itertools.product((1.3e9, 13e9, 70e9, 175e9), ("rtx4090", "h200"), (1, 4)):
        model, hw = ModelSpec.of_params(size), profiles.preset(name)
        for budget in _budgets(model):
            got = fn(model, budget, hw, m)
            call = f"choose_placement(<{size / 1e9:g}B>, host_budget={budget:,}, {name}, micro_batches={m})"
            want = best(model, budget, hw, m)
            cases += 1
            if got is None and want is None:
                continue
            if got is not None and (not isinstance(got, dict) or got not in placements()):
                raise AssertionError(f"{call} returned {got!r:.100}; expected a placement dict such as "
                                     "{'weights': 'nvme', 'state': 'nvme', 'grads': 'host'}, or None")
            if got is not None and not allowed(got):
                raise AssertionError(f"{call} returned {_shown(got)}, which the runtime refuses: gradients on the "
                                     "drive need the state there too")
            if got is not None and host_bytes(model, got) > budget:
                raise AssertionError(f"{call} returned {_shown(got)}, which needs {host_bytes(model, got):,} bytes of "
                                     f"host memory (memory.streamed_bytes), over the budget of {budget:,}: "
                                     + ("no placement fits (count the calculator's host bytes, working sets and "
                                        "buffers included): return None" if want is None else
                                        "count the calculator's host bytes, working sets and buffers included"))
            if got is None:
                raise AssertionError(f"{call} returned None, but {_shown(want)} fits: it needs "
                                     f"{host_bytes(model, want):,} bytes of host memory, within the budget (a "
                                     "placement whose bytes equal the budget fits)")
            mine, theirs = (drive_seconds(expected(model, p, m), hw) for p in (got, want))
            if mine > theirs * (1 + 1e-9):
                raise AssertionError(f"{call} returned {_shown(got)}, whose drive time is {mine:,.1f} s a step; "
                                     f"{_shown(want)} also fits and takes {theirs:,.1f} s (drive time: the bytes read "
                                     "over nvme_read plus the bytes written over nvme_write, one drive)")
            if got != want:
                raise AssertionError(f"{call} returned {_shown(got)}; {_shown(want)} ties with it on drive time and "
                                     "wins the tie (fewer host bytes, then the lab's order of placements)")
    return (f"{cases} budgets (4 models from 1.3B to 175B, rtx4090 and h200, 1 and 4 micro-batches; each placement's "
            "own host bytes, a byte less, too little for any and plenty): the least drive time that fits, or None")
