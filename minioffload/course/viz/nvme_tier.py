"""Chapter 6's figures of the NVMe tier: the swapper's bandwidth sweep, and which placement a model needs.

Pure functions: numbers in, a matplotlib Figure out.

    tune_sweep(rows, file_bytes, fio={"write": GB/s, "read": GB/s})   # rows of nvme_tune.tune: GB/s per setting
    placement_grid({(model, host): placement}, models, hosts)          # the least offloaded placement that fits

What this is not: the tuner (nvme/tune.py) nor the calculator (memory.first_placement_that_fits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...predict.memory import MiB
from .style import PLACEMENT_STYLES

NO_FIT_COLOR = "#EE9A9A"


def tune_sweep(rows: Sequence[Mapping], file_bytes: int, fio: Mapping[str, float] | None = None) -> Figure:
    """Write and read bandwidth (GB/s) against block size, one line per worker count; fio's best dashed, if given.

    A row is {"block_size": B, "workers": n, "write_GBps": ..., "read_GBps": ...}, as `nvme_tune.tune` returns."""
    if not rows:
        raise ValueError("tune_sweep needs the rows of nvme_tune.tune (one per block size and worker count)")
    blocks = sorted({r["block_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6), sharey=True)
    for ax, side in zip(axes, ("write", "read"), strict=True):
        for count in sorted({r["workers"] for r in rows}):
            mine = sorted((r for r in rows if r["workers"] == count), key=lambda r: r["block_size"])
            ax.plot([r["block_size"] / 1024 for r in mine], [r[f"{side}_GBps"] for r in mine], marker="o",
                    label=f"{count} worker{'s' if count > 1 else ''}")
        if fio and fio.get(side):
            ax.axhline(fio[side], color="gray", linestyle="--", label="fio, best (bench)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([b / 1024 for b in blocks], [f"{b // 1024}" for b in blocks])
        ax.set_xlabel("block size (KiB)")
        ax.set_title(f"Swapper {side}s, O_DIRECT, {file_bytes // MiB} MiB file")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bandwidth (GB/s)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def placement_grid(placements: Mapping[tuple[str, str], str | None], models: Sequence[str], hosts: Sequence[str],
                   title: str = "Least offloaded placement that fits") -> Figure:
    """A grid of models (rows) by host memory (columns), each cell coloured and labelled with its placement.

    `placements[model, host]` is a placement name (`memory.PLACEMENTS`) or None for "does not fit"; host labels
    ending in " GB" are shown without it."""
    missing = [(m, h) for m in models for h in hosts if (m, h) not in placements]
    if missing:
        raise ValueError(f"placement_grid has no placement for {missing[:3]}: pass one (or None) for every cell")
    fig, ax = plt.subplots(figsize=(7.2, 0.6 + 0.55 * len(models)))
    for row, m in enumerate(models):
        for col, h in enumerate(hosts):
            placement = placements[m, h]
            color = PLACEMENT_STYLES[placement][0] if placement in PLACEMENT_STYLES else NO_FIT_COLOR
            ax.add_patch(plt.Rectangle((col, row), 1, 1, color=color, alpha=0.55 if placement else 1.0, ec="white",
                                       lw=2))
            ax.text(col + 0.5, row + 0.5, placement or "does not fit", ha="center", va="center", fontsize=9)
    ax.set_xlim(0, len(hosts))
    ax.set_ylim(len(models), 0)
    ax.set_xticks(np.arange(len(hosts)) + 0.5, [h.removesuffix(" GB") for h in hosts])
    ax.set_yticks(np.arange(len(models)) + 0.5, list(models))
    ax.tick_params(length=0)
    ax.set_xlabel("host memory (GB)")
    ax.set_ylabel("model size (parameters)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
