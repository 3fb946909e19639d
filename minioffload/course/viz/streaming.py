"""The step model's timeline of a step with streamed weights, for a prefetch depth and a budget in blocks.

Not a measurement: `stepmodel.predict` places each block's fetch and compute; the budget check is the runtime's
(a block and its prefetches must fit), said in words when it refuses.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from ...predict.stepmodel import StepConfig, Workload, predict
from .timeline import _message_figure, timeline


def streamed_step(work: Workload, hw, prefetch: int, budget_blocks: int, params_on: str = "host") -> Figure:
    """The predicted step of `work` on `hw` with its blocks streamed from `params_on`, `prefetch` ahead, at most
    `budget_blocks` blocks of weights on the device; titled with the step time and the share of fetch time
    exposed."""
    title = f"depth {prefetch}, {budget_blocks} blocks, {params_on}"
    if budget_blocks < prefetch + 1:
        return _message_figure(f"refused: a budget of {budget_blocks} blocks is smaller than a block and its "
                               f"prefetch ({prefetch + 1} blocks); raise the budget or lower the prefetch", title)
    pred = predict(work, hw, StepConfig(params_on=params_on, prefetch=prefetch, mfu=1.0))
    lanes = [lane for lane in ("compute", "nvme_read", "h2d", "cpu") if pred.trace.on(lane)]
    return timeline(pred.trace, lanes=lanes, title=f"{title}: {pred.step_s * 1e3:.1f} ms, "
                                                   f"{pred.exposed_fetch_fraction:.0%} of fetches exposed")
