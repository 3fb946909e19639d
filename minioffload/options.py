"""The offload engine's options: one frozen dataclass, checked once, each rule with one message.

    options = OffloadOptions(subgroup_numel=1 << 20, max_grad_norm=1.0, stride=3)
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, options=options)  # or the same fields as keywords
    TrainConfig(optimizer=options)                                        # the training loop
    python -m minioffload train --stride 3                                # a flag per field, made from it

A new option is one field (its default, the check of its value, its help) and, when it constrains other
options, one rule in `_RULES`. `OffloadAdam`, `TrainConfig`, the step model's `StepConfig` and the CLI all
take their checks from here, so a setting is refused with the same words wherever it is given.

What this is not: the Adam hyper-parameters (lr, betas, eps, weight_decay: torch's param-group settings,
given to the optimizer as torch's are), nor where the NVMe tier's files live (a `Swapper`, built by the caller).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _option(default, valid: Callable[[object], bool], must: str, help: str, parse: Callable = int,
            metavar: str | None = None):
    """A field of OffloadOptions: `valid(value)` or the error says it `must` be ...; `parse` reads a CLI flag."""
    return field(default=default, metadata={"valid": valid, "must": must, "help": help, "parse": parse,
                                            "metavar": metavar})


def _optional(parse: Callable) -> Callable:
    def read(text: str):
        if text.strip().lower() in ("none", "off"):
            return None
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one, or 'none' to turn it off") \
                from None
    return read


def _flag(text: str) -> bool:
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not on or off; give true or false")


def _loss_scale(text: str):
    return text if text == "dynamic" else _optional(float)(text)


@dataclass(frozen=True)
class OffloadOptions:
    """How OffloadAdam offloads and updates. Refused values raise ValueError naming the option and the fix."""

    subgroup_numel: int = _option(
        1 << 22, lambda v: _int(v) and v >= 1, "a positive int",
        "elements per subgroup: the unit of one CPU Adam call, one copy, one NVMe read")
    max_grad_norm: float | None = _option(
        None, lambda v: v is None or (_number(v) and v > 0), "a positive number, or None to turn clipping off",
        "clip gradients to this global L2 norm; 'none' turns clipping off", _optional(float))
    loss_scale: str | float | None = _option(
        None, lambda v: v is None or v == "dynamic" or (_number(v) and v > 0),
        "None, 'dynamic' or a positive number", "loss scaling for fp16: a fixed scale, 'dynamic', or 'none'",
        _loss_scale)
    growth_interval: int = _option(
        2000, lambda v: _int(v) and v >= 1, "a positive int",
        "dynamic loss scaling: clean steps before the scale doubles")
    min_offload_numel: int = _option(
        0, lambda v: _int(v) and v >= 0, "an int >= 0 (0 offloads every parameter)",
        "parameters with fewer elements stay on the device, updated there by torch's AdamW")
    delay_updates_after: int | None = _option(
        None, lambda v: v is None or (_int(v) and v >= 0),
        "None (no delayed update) or the number of synchronous steps before it starts (an int >= 0)",
        "one-step delayed update (ZeRO-Offload's DPU) after N synchronous steps; off when not given",
        _optional(int), "N")
    gpu_fraction: float | None = _option(
        None, lambda v: v is None or (_number(v) and 0 <= v <= 1),
        "a number in [0, 1] (the share of subgroups whose state stays on the device)",
        "hybrid update, static: this share of subgroups keeps its state and update on the device",
        _optional(float), "F")
    stride: int | None = _option(
        None, lambda v: v is None or (_int(v) and v >= 1),
        "an int >= 1 (every stride-th subgroup is updated on the device; 1: all)",
        "hybrid update, dynamic: every K-th subgroup's state visits the device for its update", _optional(int), "K")
    bucket_numel: int | None = _option(
        None, lambda v: v is None or (_int(v) and v >= 1),
        "None (one copy per gradient tensor) or a positive int (elements per bucket)",
        "gradients leave the device in buckets of about this many elements, one copy each; 'none': one copy per "
        "tensor", _optional(int), "N")
    speculative: bool = _option(
        False, lambda v: isinstance(v, bool), "True or False",
        "start each subgroup's CPU Adam as soon as its last gradient arrives, during backward; redone exactly "
        "after backward if clipping or an overflow says so", _flag)
    backwards_per_step: int = _option(
        1, lambda v: _int(v) and v >= 1, "a positive int (micro-batches accumulated per step)",
        "speculative update: backward passes per step (gradient accumulation); it starts during the last one")
    nvme_buffers: int = _option(
        3, lambda v: _int(v) and v >= 3, "at least 3 (one set reading, one updating, one writing)",
        "NVMe tier: pinned working sets the state streams through")
    nvme_order: str = _option(
        "forward", lambda v: v in ("forward", "alternate"), "'forward' or 'alternate'",
        "NVMe tier: the order subgroups are updated in; 'alternate' reverses it every other step and updates the "
        "subgroups still in a working set first, without reading them again (MLP-Offload); 'forward' keeps it "
        "(the default, which the step model predicts)",
        str, "ORDER")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["valid"](value):
                raise ValueError(f"{f.name} must be {f.metadata['must']}, got {value!r}")
        for rule in _RULES:
            rule(self)

    def replace(self, **changes) -> OffloadOptions:
        """A copy with `changes`, checked; an unknown name raises TypeError listing the options."""
        unknown = sorted(changes.keys() - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; OffloadOptions has "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @property
    def hybrid(self) -> bool:
        return self.gpu_fraction is not None or self.stride is not None

    @property
    def delayed(self) -> bool:
        return self.delay_updates_after is not None

    def check_nvme(self) -> None:
        """The NVMe tier's rule: it combines with neither delayed nor hybrid updates yet."""
        if self.delayed or self.hybrid:
            raise ValueError("the NVMe tier does not combine with delayed or hybrid updates (delay_updates_after, "
                             "gpu_fraction, stride) yet; choose one")

    def offload_only(self) -> list[str]:
        """The options set here that only the offloaded optimizer has (a baseline on the device cannot take)."""
        return [name for name in _OFFLOAD_ONLY if getattr(self, name) != _DEFAULTS[name]]


def check_split(gpu_fraction: float | None, stride: int | None) -> None:
    """The hybrid split's rules alone (chapter 5's `device_subgroups` uses them), with OffloadOptions' messages."""
    OffloadOptions(gpu_fraction=gpu_fraction, stride=stride)


def _one_split(o: OffloadOptions) -> None:
    if o.gpu_fraction is not None and o.stride is not None:
        raise ValueError(f"set gpu_fraction (static, in [0, 1]) or stride (dynamic, an int >= 1), not both; got "
                         f"gpu_fraction={o.gpu_fraction!r} and stride={o.stride!r}")


def _delay_offloads_all(o: OffloadOptions) -> None:
    if o.delayed and o.min_offload_numel > 0:
        raise ValueError("delay_updates_after needs every parameter offloaded: the device-side AdamW of "
                         "min_offload_numel would race with the next forward; set min_offload_numel=0")


def _delay_or_hybrid(o: OffloadOptions) -> None:
    if o.delayed and o.hybrid:
        raise ValueError("delay_updates_after and a hybrid update (gpu_fraction, stride) do not combine: the "
                         "device-side update would race with the next forward; choose one")


def _speculative_alone(o: OffloadOptions) -> None:
    if o.speculative and (o.delayed or o.hybrid):
        raise ValueError("speculative and a delayed or hybrid update (delay_updates_after, gpu_fraction, stride) do "
                         "not combine: each changes when the update runs; choose one")


_RULES = (_one_split, _delay_offloads_all, _delay_or_hybrid, _speculative_alone)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadOptions)}
_OFFLOAD_ONLY = ("min_offload_numel", "delay_updates_after", "gpu_fraction", "stride", "bucket_numel", "speculative")


# the command line: one flag per field ---------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser, defaults: OffloadOptions | None = None) -> None:
    """Add --subgroup-numel, --max-grad-norm, ... to `parser`, with `defaults`' values."""
    defaults = defaults or OffloadOptions()
    group = parser.add_argument_group("offload options (OffloadOptions)")
    for f in dataclasses.fields(OffloadOptions):
        group.add_argument(flag(f.name), type=f.metadata["parse"], default=getattr(defaults, f.name),
                           metavar=f.metadata["metavar"], help=f.metadata["help"])


def from_flags(args: argparse.Namespace) -> OffloadOptions:
    """The options in parsed flags (ValueError with the flag's name when refused)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(OffloadOptions)}
    try:
        return OffloadOptions(**values)
    except ValueError as err:
        raise ValueError(name_flags(str(err))) from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def name_flags(message: str) -> str:
    """An options message with each option's name written as its flag (for errors on the command line)."""
    names = "|".join(f.name for f in dataclasses.fields(OffloadOptions))
    return re.sub(rf"\b({names})\b(?!-)", lambda m: flag(m.group(1)), message)
