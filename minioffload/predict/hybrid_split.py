"""The model of chapter 5's hybrid split, in arithmetic only: how long the update phase takes with a share of the
subgroups on the device path, the best share, and how many device scratch sets keep the link busy.

The model of the split: the CPU updates r_c params/s; the device path moves 12 B/param each way, so
over a link of b bytes/s per direction it updates about r_g = b / 12 params/s (its Adam is much faster).
Giving the device a fraction f of N parameters takes max((1 - f) N / r_c, f N / r_g); the best f
balances the two: f* = r_g / (r_c + r_g), and the update phase gets (r_c + r_g) / r_c times faster.

The CPU path's new weights go up the same link (w = 2 or 4 B/param), so the host-to-device direction carries
the device path's state coming in and the CPU path's weights: over a link of b bytes/s per direction the phase
takes the longest of the CPU, (12 f + w (1 - f)) N / b up, and 12 f N / b down (`update_time_shared`). Every
parameter moved to the device adds 12 - w bytes up, so the best f is smaller (`best_split_shared`), and 0 when
the weights alone keep the link busier than the CPU. The streamed path holds a device scratch set from its
state-in copy to its state-out copy; `scratch_sets` says how many keep the link from waiting for a free one.

What this is not: the device path (engine/device_path.py) or its Adam (kernels/device_adam.py); it imports no
torch, so the step model (predict/stepmodel.py) uses it too.
"""

from __future__ import annotations

import math

from ..layout import STATE_BYTES_PER_PARAM


def link_rate(bandwidth: float, bytes_per_param: int = STATE_BYTES_PER_PARAM) -> float:
    """Params/s the dynamic path can update when moving the state is its bottleneck (bandwidth per direction;
    the two directions overlap)."""
    return bandwidth / bytes_per_param


def update_time(fraction: float, params: int, cpu_rate: float, device_rate: float) -> float:
    """Modelled update phase (s) with `fraction` of `params` on the device path: the slower of the two."""
    return max((1 - fraction) * params / cpu_rate, fraction * params / device_rate)


def best_split(cpu_rate: float, device_rate: float) -> dict:
    """The fraction that balances CPU and device paths, and the speedup over the CPU alone."""
    if not (cpu_rate > 0 and device_rate > 0 and math.isfinite(cpu_rate) and math.isfinite(device_rate)):
        raise ValueError(f"rates must be positive and finite, got cpu_rate={cpu_rate}, device_rate={device_rate}")
    return {"fraction": device_rate / (cpu_rate + device_rate), "speedup": (cpu_rate + device_rate) / cpu_rate}


def _check_positive(**figures: float) -> None:
    for name, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be positive and finite, got {value!r}")


def _check_weight_bytes(weight_bytes) -> None:
    if weight_bytes not in (2, 4) or isinstance(weight_bytes, bool):
        raise ValueError(f"weight_bytes must be 2 (bf16/fp16 weights) or 4 (fp32 weights), got {weight_bytes!r}")


def phase_times(fraction: float, params: float, cpu_rate: float, bandwidth: float, weight_bytes: int) -> dict:
    """Seconds each resource of the update phase is busy with `fraction` of `params` on the device path: "cpu" (the
    CPU path's Adam), "h2d" (the device path's state in and the CPU path's weights up) and "d2h" (the state out).
    `bandwidth` is the link's, per direction; the device's own Adam is taken to be much faster than the link."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    _check_positive(params=params, cpu_rate=cpu_rate, bandwidth=bandwidth)
    _check_weight_bytes(weight_bytes)
    state = STATE_BYTES_PER_PARAM * fraction * params
    return {"cpu": (1 - fraction) * params / cpu_rate,
            "h2d": (state + weight_bytes * (1 - fraction) * params) / bandwidth,
            "d2h": state / bandwidth}


def update_time_shared(fraction: float, params: float, cpu_rate: float, bandwidth: float, weight_bytes: int) -> float:
    """Modelled update phase (s) when the CPU path's weight uploads share the link with the device path's state:
    the busiest of the CPU and the two link directions (`phase_times`)."""
    return max(phase_times(fraction, params, cpu_rate, bandwidth, weight_bytes).values())


def best_split_shared(cpu_rate: float, bandwidth: float, weight_bytes: int) -> dict:
    """The fraction that balances the CPU against the host-to-device direction (the busier one: it carries the
    device path's state in and the CPU path's weights), and the speedup over the CPU path alone (whose uploads
    the link carries too). The up direction's time per param, 12 f + w (1 - f) over the bandwidth, grows with f and
    the CPU's, (1 - f) / cpu_rate, shrinks: they meet at f* below, or the link is the bottleneck already at f = 0."""
    _check_positive(cpu_rate=cpu_rate, bandwidth=bandwidth)
    _check_weight_bytes(weight_bytes)
    cpu_s, weights_s, state_s = 1 / cpu_rate, weight_bytes / bandwidth, STATE_BYTES_PER_PARAM / bandwidth
    # (1 - f) cpu_s = f state_s + (1 - f) weights_s  =>  f = (cpu_s - weights_s) / (cpu_s - weights_s + state_s)
    fraction = max(0.0, (cpu_s - weights_s) / (cpu_s - weights_s + state_s))
    alone = update_time_shared(0.0, 1, cpu_rate, bandwidth, weight_bytes)
    return {"fraction": fraction, "speedup": alone / update_time_shared(fraction, 1, cpu_rate, bandwidth, weight_bytes)}


def scratch_sets(subgroup_numel: int, bandwidth: float, adam_rate: float, latency: float = 10e-6) -> int:
    """Device scratch sets the streamed (stride) path needs so that the link never waits for a free one. A set is
    held from the start of its state-in copy (12 B/param over the link, per direction) through the device Adam to
    the end of its state-out copy; the pipeline takes a new one every max(copy in, Adam, copy out) seconds. At
    least 2 (one copying while the other computes)."""
    if isinstance(subgroup_numel, bool) or not isinstance(subgroup_numel, int) or subgroup_numel < 1:
        raise ValueError(f"subgroup_numel must be a positive int, got {subgroup_numel!r}")
    _check_positive(bandwidth=bandwidth, adam_rate=adam_rate)
    if not (latency >= 0 and math.isfinite(latency)):
        raise ValueError(f"latency must be >= 0 and finite (seconds per copy), got {latency!r}")
    copy = latency + subgroup_numel * STATE_BYTES_PER_PARAM / bandwidth  # each way
    adam = subgroup_numel / adam_rate
    held, period = 2 * copy + adam, max(copy, adam)
    return max(2, math.ceil(held / period * (1 - 1e-12)))  # a set freed just in time is enough


def nearest_stride(fraction: float) -> int:
    """The stride whose share of subgroups (1/k) is closest to `fraction` (> 0)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    low = max(1, math.floor(1 / fraction))
    return min((low, low + 1), key=lambda k: abs(1 / k - fraction))
