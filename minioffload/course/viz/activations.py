"""Figures of chapter 7 (activations): device memory over one step, one line per activation policy, and offload's
overhead against the link's bandwidth, measured beside the cost model's.

Pure functions: numbers in, a matplotlib Figure out (plus `ledger_series`, the numbers behind the first figure).
What this is not: the measurement (the chapter's cells, bench/activations.py) nor the cost model
(`minioffload.predict.activation_cost`); these only draw what those produced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .style import fallback_color

MiB = 2**20
POLICY_COLORS = {"keep": "#4C72B0", "offload": "#DD8452", "recompute": "#55A868", "selective": "#C44E52",
                 "offload_input": "#8172B3"}


def policy_color(policy: str) -> str:
    return POLICY_COLORS.get(policy) or fallback_color(policy)


def ledger_series(events: Sequence, base: int = 0) -> tuple[list[float], list[float]]:
    """(ms since the first event, MiB in use beyond `base` bytes) after each ledger event (anything with `.time`
    in seconds and `.used` in bytes). Refuses an empty list: there is nothing to draw."""
    if not events:
        raise ValueError("ledger_series needs at least one event; pass the device tier's events of the step")
    t0 = events[0].time
    return [(e.time - t0) * 1e3 for e in events], [(e.used - base) / MiB for e in events]


def memory_by_policy(series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                     peaks_mib: Mapping[str, float] | None = None,
                     title: str = "Memory over one step, by policy") -> Figure:
    """One step line per policy of device memory beyond the weights (MiB) against time in the step (ms).
    `series` maps a policy to (times_ms, used_mib), e.g. from `ledger_series`; `peaks_mib` puts each peak in the
    legend."""
    if not series:
        raise ValueError("memory_by_policy needs at least one policy's series")
    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    for policy, (times, used) in series.items():
        peak = (peaks_mib or {}).get(policy)
        label = policy if peak is None else f"{policy} (peak {peak:.0f} MiB)"
        ax.step(list(times), list(used), where="post", color=policy_color(policy), lw=1.6, label=label)
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("device memory beyond the weights (MiB)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="y", color="0.9")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def offload_crossover(links_gbps: Sequence[float], measured: Sequence[float], predicted: Sequence[float],
                      hide_gbps: float, title: str = "Offload's overhead against the link (sim)") -> Figure:
    """Offload's step over keep's against the link's bandwidth (GB/s, log axis): measured and modelled lines, the
    bandwidth above which the model calls offload free (dotted), and 1.0 (keep's step)."""
    if not len(links_gbps) == len(measured) == len(predicted) or not len(links_gbps):
        raise ValueError(f"links_gbps, measured and predicted must be equally long and not empty, got "
                         f"{len(links_gbps)}, {len(measured)}, {len(predicted)}")
    fig, ax = plt.subplots(figsize=(7.2, 3.2))
    ax.plot(list(links_gbps), list(measured), "o-", label="measured", color="#55A868")
    ax.plot(list(links_gbps), list(predicted), "s--", label="model", color="#8172B3")
    ax.axvline(hide_gbps, color="gray", ls=":", label=f"model: free above {hide_gbps:.1f} GB/s")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(list(links_gbps), [f"{g:g}" for g in links_gbps])
    ax.set_xlabel("link bandwidth each way (GB/s)")
    ax.set_ylabel("offload step / keep step")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
