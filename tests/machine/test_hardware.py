"""Bandwidth probes: the sim device's measured copy bandwidth follows its link model."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minioffload.course import viz  # noqa: E402
from minioffload.devices import Link, device  # noqa: E402
from minioffload.machine import measure as hardware  # noqa: E402
from minioffload.predict.memory import MiB  # noqa: E402


def test_host_memory_bandwidth_is_positive_and_refuses_bad_sizes():
    assert hardware.host_memory_bandwidth(8 * MiB, repeats=2) > 0
    with pytest.raises(ValueError):
        hardware.host_memory_bandwidth(0)


def test_sim_copy_bandwidth_stays_under_the_link_and_pageable_is_slower():
    link = Link(bandwidth=1e9, latency=20e-6)
    # not strict: the hazard checker's checksums of in-flight sources would add host time to what is timed here
    with device("sim", h2d=link, d2h=link, pageable_slowdown=2.0, strict=False) as dev:
        rows = hardware.copy_bandwidth_sweep(dev, sizes=[64 * 1024, 16 * MiB], repeats=3)
    assert len(rows) == 8 and {r["direction"] for r in rows} == {"h2d", "d2h"}
    big = {(r["direction"], r["pinned"]): r["bytes_per_s"] for r in rows if r["bytes"] == 16 * MiB}
    small = {(r["direction"], r["pinned"]): r["bytes_per_s"] for r in rows if r["bytes"] != 16 * MiB}
    for direction in ("h2d", "d2h"):
        assert big[direction, True] <= 1.0e9  # never above the link (how near depends on how busy the machine is)
        assert big[direction, False] < 0.75 * big[direction, True]  # pageable: slower (modelled 2x; load narrows it)
        assert small[direction, True] < big[direction, True]  # small copies pay the fixed costs
    fig = viz.bandwidth_vs_size(rows, link.bandwidth)
    assert len([line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]) == 4


def test_copy_bandwidth_refuses_bad_arguments(sim):
    with pytest.raises(ValueError, match="direction"):
        hardware.copy_bandwidth(sim, [4096], direction="sideways")
    with pytest.raises(ValueError, match="multiples of 4"):
        hardware.copy_bandwidth(sim, [6])
    assert sim.ledger.used("device") == 0
