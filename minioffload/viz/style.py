"""Colours and orders shared by every figure, so a tier or a lane looks the same in every chapter."""

TIER_COLORS = {"device": "#4C72B0", "host": "#DD8452", "nvme": "#55A868"}
PART_COLORS = {
    "weights": "#4C72B0",
    "grads": "#8172B3",
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
}
