"""The run's settings: where the training state lives (`Placement`) and how the offload engine offloads and updates
(`OffloadOptions`), each a frozen dataclass checked field by field, and ONE table of the rules that combine them.

    options = OffloadOptions(subgroup_numel=1 << 20, max_grad_norm=1.0, stride=3)
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3, options=options)  # or the same fields as keywords
    TrainConfig(optimizer=options)                                        # the training loop
    StepConfig(optimizer_on="nvme", delay_updates_after=0)                # refused, in the rule's words
    check_run(Placement(params_on="host"), options)                       # what the runtime runs: ValueError if not
    python -m minioffload train --stride 3                                # a flag per field, made from it

A new setting is one field (its default, the check of its value, its help) and, when it constrains other settings,
one rule in `_RULES`. `OffloadAdam`, `TrainConfig`, the step model's `StepConfig`, a planner's `Plan` and the CLI
all take their checks from here, so a setting is refused with the same words wherever it is given. A rule says
whether the runtime cannot run the combination (RUN: OffloadAdam, train), the step model does not predict it (MODEL),
or both; the step model also predicts plain data parallel ranks with torch's AdamW, which the runtime does not run.

What this is not: the Adam hyper-parameters (lr, betas, eps, weight_decay: torch's param-group settings,
given to the optimizer as torch's are), nor where the NVMe tier's files live (a `Swapper`, built by the caller), nor
the training loop's own settings (model, batch, steps: train/config.py's TrainConfig).
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
    grad_buffers: int = _option(
        3, lambda v: _int(v) and v >= 2, "at least 2 (one set filling while another is written)",
        "gradients on NVMe (grads_on='nvme'): pinned sets, each the largest subgroup's fp32 gradient and staging, "
        "that the gradients pass through on their way to the drive")
    nvme_order: str = _option(
        "forward", lambda v: v in ("forward", "alternate"), "'forward' or 'alternate'",
        "NVMe tier: the order subgroups are updated in; 'alternate' reverses it every other step and updates the "
        "subgroups still in a working set first, without reading them again (MLP-Offload); 'forward' keeps it "
        "(the default, which the step model predicts)",
        str, "ORDER")

    def __post_init__(self) -> None:
        _check_fields(self)
        _check(Placement(), self, (RUN, MODEL))  # the rules of the options alone: the engine's default placement

    def replace(self, **changes) -> OffloadOptions:
        """A copy with `changes`, checked; an unknown name raises TypeError listing the options."""
        return _replace(self, changes, "option")

    @property
    def hybrid(self) -> bool:
        return self.gpu_fraction is not None or self.stride is not None

    @property
    def delayed(self) -> bool:
        return self.delay_updates_after is not None

    @property
    def clips(self) -> bool:
        return self.max_grad_norm is not None

    def offload_only(self) -> list[str]:
        """The options set here that only the offloaded optimizer has (a baseline on the device cannot take)."""
        return [name for name in _OFFLOAD_ONLY if getattr(self, name) != _DEFAULTS[name]]


def _check_fields(settings) -> None:
    for f in dataclasses.fields(settings):
        check_field(type(settings), f.name, getattr(settings, f.name))


def check_field(kind: type, name: str, value) -> None:
    """The check of one field of OffloadOptions or Placement, with its message: check_field(Placement, "ranks", 0)."""
    f = next(f for f in dataclasses.fields(kind) if f.name == name)
    if not f.metadata["valid"](value):
        raise ValueError(f"{name} must be {f.metadata['must']}, got {value!r}")


def _replace(settings, changes: dict, what: str):
    names = [f.name for f in dataclasses.fields(settings)]
    unknown = sorted(changes.keys() - set(names))
    if unknown:
        raise TypeError(f"unknown {what}(s) {', '.join(unknown)}; {type(settings).__name__} has {', '.join(names)}")
    return dataclasses.replace(settings, **changes)


HOMES = ("device", "host", "nvme")


@dataclass(frozen=True)
class Placement:
    """Where the training state lives, and over how many ranks. Refused values raise ValueError naming the field.

    The optimizer on the "device" is torch's AdamW there, nothing offloaded; on the "host" it is OffloadAdam (state
    in pinned host memory, the update on the CPU), on "nvme" its NVMe tier. The blocks' weights stay on the device,
    or are streamed block by block from their home ("host" or "nvme"), `prefetch` blocks ahead. With `ranks` > 1
    each rank has a device and the offloaded optimizer's state is sharded over them (weights replicated). The
    gradients wait for the update in pinned host memory, or with `grads_on="nvme"` on the NVMe tier's drive."""

    optimizer_on: str = _option(
        "host", lambda v: v in HOMES, "one of 'device', 'host', 'nvme'",
        "where the optimizer's state lives and its update runs: 'device' (torch's AdamW, nothing offloaded), "
        "'host' (OffloadAdam: pinned host memory and the CPU) or 'nvme' (its NVMe tier)", str, "HOME")
    params_on: str = _option(
        "device", lambda v: v in HOMES, "one of 'device', 'host', 'nvme'",
        "where the blocks' weights live: on the device, or streamed block by block from pinned host memory or from "
        "NVMe", str, "HOME")
    prefetch: int = _option(
        1, lambda v: _int(v) and v >= 0, "an int >= 0 (blocks fetched ahead; 0 fetches on demand)",
        "streamed weights: blocks fetched ahead of the one computing")
    ranks: int = _option(
        1, lambda v: _int(v) and v >= 1, "an int >= 1 (processes, one device each)",
        "processes, one device each: the offloaded optimizer's state sharded over them, weights replicated")
    grads_on: str = _option(
        "host", lambda v: v in ("host", "nvme"), "'host' or 'nvme'",
        "where the offloaded optimizer's gradients wait for the update: summed in pinned host memory (4 B/param and "
        "a staging buffer), or on the NVMe tier's drive through grad_buffers pinned sets", str, "HOME")

    def __post_init__(self) -> None:
        _check_fields(self)

    def replace(self, **changes) -> Placement:
        """A copy with `changes`, checked; an unknown name raises TypeError listing the fields."""
        return _replace(self, changes, "placement field")

    @property
    def offloaded(self) -> bool:
        return self.optimizer_on != "device"

    @property
    def streamed(self) -> bool:
        return self.params_on != "device"


def check_split(gpu_fraction: float | None, stride: int | None) -> None:
    """The hybrid split's rules alone (chapter 5's `device_subgroups` uses them), with OffloadOptions' messages."""
    OffloadOptions(gpu_fraction=gpu_fraction, stride=stride)


# the rules: each one function of (placement, options), returning its one message when broken ------------------------
RUN, MODEL = "run", "model"  # the runtime (OffloadAdam, train) cannot run it | the step model does not predict it
# a setting written as "name=value (train: its TrainConfig spelling)": the train command names its own flag
_ON_DEVICE = "optimizer_on='device' (train: offload=False) keeps torch's AdamW on the device"
_OFFLOAD = "offload the optimizer, optimizer_on='host' (train: offload=True)"


def _one_split(p: Placement, o: OffloadOptions) -> str | None:
    if o.gpu_fraction is not None and o.stride is not None:
        return (f"set gpu_fraction (static, in [0, 1]) or stride (dynamic, an int >= 1), not both; got "
                f"gpu_fraction={o.gpu_fraction!r} and stride={o.stride!r}")


def _delay_offloads_all(p: Placement, o: OffloadOptions) -> str | None:
    if o.delayed and o.min_offload_numel > 0:
        return ("delay_updates_after needs every parameter offloaded: the device-side AdamW of min_offload_numel "
                "would race with the next forward; set min_offload_numel=0")


def _delay_or_hybrid(p: Placement, o: OffloadOptions) -> str | None:
    if o.delayed and o.hybrid:
        return ("delay_updates_after and a hybrid update (gpu_fraction, stride) do not combine: the device-side "
                "update would race with the next forward; choose one")


def _speculative_alone(p: Placement, o: OffloadOptions) -> str | None:
    if o.speculative and (o.delayed or o.hybrid):
        return ("speculative and a delayed or hybrid update (delay_updates_after, gpu_fraction, stride) do not "
                "combine: each changes when the update runs; choose one")


def _offload_only(p: Placement, o: OffloadOptions) -> str | None:
    named = o.offload_only()
    if not p.offloaded and named:
        one = len(named) == 1
        return (f"{', '.join(named)} {'is an option' if one else 'are options'} of the offloaded optimizer "
                f"(OffloadAdam), and {_ON_DEVICE}: drop {'it' if one else 'them'}, or {_OFFLOAD}")


def _streamed_needs_offload(p: Placement, o: OffloadOptions) -> str | None:
    if p.streamed and not p.offloaded:
        return (f"params_on={p.params_on!r} streams weights that the CPU optimizer updates, and {_ON_DEVICE}: "
                f"{_OFFLOAD}, or set params_on='device'")


def _ranks_need_offload(p: Placement, o: OffloadOptions) -> str | None:
    if p.ranks > 1 and not p.offloaded:
        return (f"sharding the optimizer state, ranks={p.ranks} (train: shard), needs the offloaded optimizer, and "
                f"{_ON_DEVICE} (data parallel, which the runtime does not run): {_OFFLOAD}, or run one rank")


def _streamed_synchronous(p: Placement, o: OffloadOptions) -> str | None:
    if p.streamed and (o.delayed or o.hybrid):
        return (f"streamed weights (params_on={p.params_on!r}) take the synchronous CPU update only: they are "
                "updated on the CPU and sent home between steps, so delay_updates_after, gpu_fraction and stride "
                "need them on the device; leave those off, or set params_on='device'")


def _nvme_synchronous(p: Placement, o: OffloadOptions) -> str | None:
    if p.optimizer_on == "nvme" and (o.delayed or o.hybrid):
        return ("the NVMe tier does not combine with delayed or hybrid updates (delay_updates_after, gpu_fraction, "
                "stride) yet; choose one: those, or optimizer_on='nvme' (train: nvme_dir)")


def _sharded_synchronous(p: Placement, o: OffloadOptions) -> str | None:
    if p.ranks > 1 and (o.delayed or o.hybrid or o.speculative):
        return (f"the optimizer state sharded, ranks={p.ranks} (train: shard), runs the synchronous CPU update: "
                "leave delay_updates_after, gpu_fraction, stride and speculative off, or run one rank")


def _speculative_resident(p: Placement, o: OffloadOptions) -> str | None:
    if o.speculative and p.streamed:
        return (f"speculative=True uploads the new weights, and streamed weights (params_on={p.params_on!r}) take "
                "the synchronous CPU update only; set speculative=False, or params_on='device'")


def _speculative_on_host(p: Placement, o: OffloadOptions) -> str | None:
    if o.speculative and p.optimizer_on == "nvme":
        return ("speculative=True keeps a second set of state in host memory: the engine builds it for the host "
                "tier, not the NVMe tier; set speculative=False, or optimizer_on='host' (train: no nvme_dir)")


def _ranks_resident(p: Placement, o: OffloadOptions) -> str | None:
    if p.ranks > 1 and p.streamed:
        return (f"params_on={p.params_on!r} with ranks={p.ranks}: the step model predicts a sharded state with every "
                "weight on each device, not streamed; set params_on='device' or ranks=1")


def _grads_on_nvme_tier(p: Placement, o: OffloadOptions) -> str | None:
    if p.grads_on == "nvme" and p.optimizer_on != "nvme":
        return (f"grads_on='nvme' keeps the gradients on the NVMe tier's drive, and optimizer_on={p.optimizer_on!r}: "
                "put the optimizer's state there too, optimizer_on='nvme' (train: nvme_dir), or grads_on='host'")


def _grads_on_nvme_synchronous(p: Placement, o: OffloadOptions) -> str | None:
    if p.grads_on == "nvme" and (o.delayed or o.hybrid or o.speculative or o.bucket_numel is not None
                                 or p.ranks > 1):
        return ("grads_on='nvme' runs the synchronous CPU update of one process, its gradients one copy per tensor: "
                "leave delay_updates_after, gpu_fraction, stride, speculative and bucket_numel off and run one rank, "
                "or set grads_on='host'")


_RULES = (  # (rule, where it holds), the first broken one's message is raised
    (_one_split, (RUN, MODEL)), (_delay_offloads_all, (RUN, MODEL)), (_delay_or_hybrid, (RUN, MODEL)),
    (_speculative_alone, (RUN, MODEL)), (_offload_only, (RUN, MODEL)), (_streamed_needs_offload, (RUN, MODEL)),
    (_ranks_need_offload, (RUN,)), (_streamed_synchronous, (RUN, MODEL)), (_nvme_synchronous, (RUN, MODEL)),
    (_sharded_synchronous, (RUN, MODEL)), (_speculative_resident, (RUN, MODEL)),
    (_speculative_on_host, (RUN,)), (_ranks_resident, (MODEL,)), (_grads_on_nvme_tier, (RUN, MODEL)),
    (_grads_on_nvme_synchronous, (RUN, MODEL)),
)


def _check(placement: Placement, options: OffloadOptions, scopes: tuple[str, ...]) -> None:
    for rule, holds in _RULES:
        message = rule(placement, options) if set(holds) & set(scopes) else None
        if message:
            raise ValueError(message)


def check_run(placement: Placement, options: OffloadOptions) -> None:
    """What the runtime runs (OffloadAdam, train): ValueError with the broken rule's message, naming the settings
    and the fix."""
    _check(placement, options, (RUN,))


def check_model(placement: Placement, options: OffloadOptions) -> None:
    """What the step model predicts (StepConfig): ValueError with the broken rule's message."""
    _check(placement, options, (MODEL,))


def settings(placement: Placement | None = None, options: OffloadOptions | None = None, **fields
             ) -> tuple[Placement, OffloadOptions]:
    """`placement` and `options` (their defaults when None) with `fields` set, each a field of one of them:
    settings(optimizer_on="nvme", subgroup_numel=1 << 20). An unknown name raises TypeError listing both."""
    placement, options = placement or Placement(), options or OffloadOptions()
    names = {f.name for f in dataclasses.fields(Placement)}
    unknown = sorted(fields.keys() - names - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; Placement has {', '.join(sorted(names))} and "
                        f"OffloadOptions has {', '.join(_DEFAULTS)}")
    return (placement.replace(**{k: v for k, v in fields.items() if k in names}),
            options.replace(**{k: v for k, v in fields.items() if k not in names}))


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadOptions)}
_OFFLOAD_ONLY = ("min_offload_numel", "delay_updates_after", "gpu_fraction", "stride", "bucket_numel", "speculative")


# the command line: one flag per field ---------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser, defaults: OffloadOptions | Placement | None = None,
              names: tuple[str, ...] | None = None) -> None:
    """Add a flag per field of `defaults`' class (OffloadOptions unless given: --subgroup-numel, --max-grad-norm, ...;
    a Placement: --optimizer-on, --params-on, ...), or of the fields in `names`, with `defaults`' values."""
    defaults = defaults or OffloadOptions()
    kind = type(defaults)
    title = "offload options (OffloadOptions)" if kind is OffloadOptions else "placement (Placement)"
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(kind):
        if names is None or f.name in names:
            group.add_argument(flag(f.name), type=f.metadata["parse"], default=getattr(defaults, f.name),
                               metavar=f.metadata["metavar"], help=f.metadata["help"])


def from_flags(args: argparse.Namespace, kind: type = OffloadOptions):
    """The OffloadOptions (or, with `kind`, the Placement) in parsed flags, a field whose flag the parser lacks at its
    default (ValueError with the flag's name when refused)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(kind) if hasattr(args, f.name)}
    try:
        return kind(**values)
    except ValueError as err:
        raise ValueError(name_flags(str(err))) from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def name_flags(message: str, names: tuple[str, ...] | None = None) -> str:
    """A settings message with each option's and placement field's name (or those in `names`) written as its flag
    (for errors on the command line)."""
    if names is None:
        names = (*_DEFAULTS, *(f.name for f in dataclasses.fields(Placement)))
    return re.sub(rf"(?<![-\w])({'|'.join(names)})\b(?!-)", lambda m: flag(m.group(1)), message)
