"""Figures for chapter 1: where the bytes of a training setup live, and what fits on which GPU.

Pure functions: arguments in, a matplotlib Figure out, no global state and no display. The widgets
in `minioffload.course.widgets` wrap them; tests call them directly.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ...predict.memory import GB, PLACEMENTS, TIERS, footprint
from .style import PART_COLORS, PLACEMENT_STYLES


def footprint_figure(num_params: float, precision: str = "mixed_bf16", optimizer: str = "adam",
                     placement: str = "device", gpu_bytes: float = 80 * GB,
                     activation_bytes: float = 0) -> Figure:
    """Stacked bars of GB per tier (device, host, nvme), one segment per part, GPU capacity dashed."""
    fp = footprint(precision, optimizer, placement)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bottoms = np.zeros(len(TIERS))
    segments = [(p.name, p.tier, num_params * p.bytes_per_param) for p in fp.parts]
    if activation_bytes:
        segments.append(("activations", "device", activation_bytes))
    for name, tier, nbytes in segments:
        heights = np.array([nbytes / GB if t == tier else 0.0 for t in TIERS])
        ax.bar(TIERS, heights, bottom=bottoms, color=PART_COLORS[name], edgecolor="white",
               label=name if name not in ax.get_legend_handles_labels()[1] else None)
        bottoms += heights
    ax.axhline(gpu_bytes / GB, color="black", ls="--", lw=1)
    ax.annotate(f"GPU {gpu_bytes / GB:.0f} GB", (2.45, gpu_bytes / GB), xytext=(0, 3),
                textcoords="offset points", ha="right", fontsize=8)
    ax.set_ylim(0, max(bottoms.max(), gpu_bytes / GB) * 1.12)
    device_total = bottoms[0]
    verdict = "fits" if device_total <= gpu_bytes / GB else "does NOT fit"
    ax.set_title(f"{num_params / 1e9:.3g}B params, {precision}, {optimizer}, {placement}: "
                 f"device {device_total:.0f} GB, {verdict}", fontsize=9)
    ax.set_ylabel("GB")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def fit_chart(models: dict[str, float], gpus: dict[str, float], precision: str = "mixed_bf16",
              optimizer: str = "adam") -> Figure:
    """Device GB needed against model size, one line per placement, one dashed line per GPU."""
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    sizes = np.logspace(np.log10(min(models.values()) / 2), np.log10(max(models.values()) * 2), 100)
    by_device_bytes: dict[int, list[str]] = {}  # placements that leave the same B/param on the GPU
    for placement in PLACEMENTS:
        per_param = footprint(precision, optimizer, placement).per_param("device")
        by_device_bytes.setdefault(per_param, []).append(placement)
    for per_param, placements in by_device_bytes.items():
        if per_param == 0:
            continue  # streams its weights: no per-parameter device state to draw
        color, style = PLACEMENT_STYLES[placements[0]]
        ax.plot(sizes, sizes * per_param / GB, style, color=color,
                label=f"{' / '.join(placements)} ({per_param} B/param)")
    for name, capacity in gpus.items():
        ax.axhline(capacity / GB, color="gray", lw=1, ls=(0, (4, 2)))
        ax.text(sizes[0], capacity / GB * 1.08, name, fontsize=8, color="dimgray")
    for name, n in models.items():
        ax.axvline(n, color="lightgray", lw=0.8, zorder=0)
        ax.text(n, 0.1, name, rotation=90, fontsize=7, va="bottom", ha="right", color="dimgray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("resident on the GPU (GB)")
    ax.set_title(f"What stays on the GPU ({precision}, {optimizer}; activations not counted)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def fit_grid(models: dict[str, float], gpus: dict[str, float], precision: str = "mixed_bf16",
             optimizer: str = "adam") -> Figure:
    """A table of models x placements: device GB in each cell, coloured by the smallest GPU it fits."""
    gpu_names = sorted(gpus, key=gpus.get)
    fig, ax = plt.subplots(figsize=(7.2, 0.45 * len(models) + 1.4))
    palette = ["#9BD39B", "#F3D77C", "#EE9A9A"]  # fits the smallest GPU, a larger one, none
    for row, n in enumerate(models.values()):
        for col, placement in enumerate(PLACEMENTS):
            device_gb = footprint(precision, optimizer, placement).bytes(n, "device") / GB
            fits = [g for g in gpu_names if device_gb * GB <= gpus[g]]
            level = 2 if not fits else min(gpu_names.index(fits[0]), 1)
            ax.add_patch(plt.Rectangle((col, row), 1, 1, color=palette[level], ec="white"))
            ax.text(col + 0.5, row + 0.5, f"{device_gb:,.1f} GB", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(PLACEMENTS))
    ax.set_ylim(len(models), 0)
    ax.set_xticks(np.arange(len(PLACEMENTS)) + 0.5, PLACEMENTS, fontsize=8)
    ax.set_yticks(np.arange(len(models)) + 0.5, list(models), fontsize=8)
    ax.tick_params(length=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in palette]
    larger = gpu_names[-1] if len(gpu_names) == 2 else "a larger GPU"
    labels = [f"fits {gpu_names[0]}", f"fits {larger} only", "fits none"]
    ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3,
              frameon=False)
    ax.set_title(f"Per-parameter state resident on the GPU ({precision}, {optimizer})", fontsize=10)
    fig.tight_layout()
    return fig
