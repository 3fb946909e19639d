"""Colours and orders shared by every figure, so a tier or a lane looks the same in every chapter."""

import zlib

TIER_COLORS = {"device": "#4C72B0", "host": "#DD8452", "nvme": "#55A868"}
PART_COLORS = {
    "weights": "#4C72B0",
    "grads": "#8172B3",
    "staging": "#B4A7D6",
    "upload": "#9DB4D8",
    "previous": "#A6D3A8",
    "master": "#C44E52",
    "exp_avg": "#DD8452",
    "exp_avg_sq": "#CCB974",
    "momentum": "#DD8452",
    "activations": "#64B5CD",
}
PLACEMENT_STYLES = {  # placement -> (colour, line style)
    "device": ("#4C72B0", "-"),
    "optimizer_cpu": ("#DD8452", "--"),
    "optimizer_nvme": ("#55A868", "-."),
    "params_cpu": ("#C44E52", ":"),
    "params_nvme": ("#8172B3", (0, (1, 3))),
}

# One colour per lane of `trace.LANE_ORDER`: copies in blue/orange (to and from the device),
# device compute green, CPU work purple, NVMe reads/writes teal/red, host bookkeeping gray.
LANE_COLORS = {
    "host": "#8C8C8C",
    "h2d": "#4C72B0",
    "compute": "#55A868",
    "d2h": "#DD8452",
    "cpu": "#8172B3",
    "nvme_read": "#3BA3B8",
    "nvme_write": "#C44E52",
}

# For names nobody listed above; chosen to differ from the named colours.
FALLBACK_COLORS = ("#937860", "#DA8BC3", "#CCB974", "#2F4B7C", "#A05195", "#6B8E23", "#E377C2", "#17BECF")


def fallback_color(name: str) -> str:
    """A colour for `name` that is the same in every run (crc32, not Python's salted `hash`)."""
    return FALLBACK_COLORS[zlib.crc32(name.encode()) % len(FALLBACK_COLORS)]


def lane_color(lane: str) -> str:
    return LANE_COLORS.get(lane) or fallback_color(lane)


def tier_color(tier: str) -> str:
    return TIER_COLORS.get(tier) or fallback_color(tier)
