"""Command line: `python -m minioffload COMMAND ...`.

Commands so far:
    footprint   bytes per parameter and per tier for a model size, precision, optimizer and placement,
                and whether it fits a GPU (chapter 1's calculator)
    train       train a small GPT with its optimizer state offloaded to the host (or the on-device
                baseline) and print where the step time goes (minioffload/train.py)
    hardware    the hardware table: every preset's figures, one preset's figures with their sources, or
                this machine measured (--probe)
    step        the step model: a step's predicted time, bound resource and exposed time for a model size,
                a hardware preset and an offload configuration

Later chapters add `plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys

from . import memory
from .units import parse_bytes

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7B' -> 7e9, '124M' -> 1.24e8, '1.5e9' -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", text.lower())
    if not match or not 0 < float(match[1]) * _SUFFIXES[match[2]] < 1e18:  # finite, and below a billion billion
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive parameter count; write e.g. 7B, 124M, 1.5e9")
    return float(match[1]) * _SUFFIXES[match[2]]


def _bytes(text: str) -> int:
    """argparse's type for a size in bytes (units.parse_bytes)."""
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def footprint_command(args: argparse.Namespace) -> int:
    fp = memory.footprint(args.precision, args.optimizer, args.placement, delay=args.delay)
    print(f"{args.params / 1e9:.3g}B parameters, {args.precision}, {args.optimizer}, {args.placement}\n")
    print(fp.table())
    print()
    for tier in memory.TIERS:
        if fp.per_param(tier):
            print(f"{tier:<7} {fp.bytes(args.params, tier) / memory.GB:>10,.1f} GB")
    device = fp.bytes(args.params, "device")
    fits = device <= args.gpu_gb * memory.GB
    print(f"\n{'fits' if fits else 'does NOT fit'} one {args.gpu_gb:g} GB GPU "
          f"({device / memory.GB:,.1f} GB of per-parameter state; activations not counted)")
    if not fits:
        better = memory.first_placement_that_fits(args.params, args.gpu_gb * memory.GB, args.precision,
                                                  args.optimizer)
        print(f"least offloaded placement that fits: {better or 'none'}")
    return 0


def hardware_command(args: argparse.Namespace) -> int:
    from . import profiles

    if args.probe or args.name:
        hw = profiles.probe() if args.probe else profiles.preset(args.name)
        print(f"{hw.name}: {hw.description}\n")
        for row in hw.table():
            print(f"{row['figure']:<18}{_si(row['value'], row['unit']):>16}  {row['source']}")
        return 0
    print(f"{'preset':<11}{'memory':>9}{'HBM':>11}{'bf16':>12}{'link (theory)':>20}{'host':>11}"
          f"{'CPU Adam':>13}{'NVMe r/w':>14}")
    for hw in profiles.PRESETS.values():
        print(f"{hw.name:<11}{hw.device_memory / memory.GB:>6.0f} GB{hw.device_bandwidth / 1e12:>6.2f} TB/s"
              f"{hw.peak_flops_bf16 / 1e12:>7.0f} TFLOP/s"
              f"{hw.link_h2d / 1e9:>6.1f} ({hw.link_theoretical / 1e9:.1f}) GB/s"
              f"{hw.host_bandwidth / 1e9:>6.0f} GB/s{hw.cpu_adam_rate / 1e9:>6.2f} Gpar/s"
              f"{hw.nvme_read / 1e9:>6.1f}/{hw.nvme_write / 1e9:.1f} GB/s")
    print("\nachieved pinned link (theoretical); host: Adam-pattern bandwidth of the GPU's share of the host. "
          "Sources: hardware NAME")
    return 0


def _si(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / memory.GB:,.1f} GB"
    if unit == "s":
        return f"{value * 1e6:,.1f} us"
    if not unit:
        return f"{value:g}"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def step_command(args: argparse.Namespace) -> int:
    from . import profiles, stepmodel

    hw = profiles.probe() if args.hardware == "probe" else profiles.preset(args.hardware)
    pred = stepmodel.predict(args.work, hw, args.step_config)
    print(f"{args.params / 1e9:.3g}B parameters, {args.tokens:,} tokens per step, {args.precision}, on {hw.name}")
    print(f"predicted step {pred.step_s:.3f} s ({args.tokens / pred.step_s:,.0f} tokens/s), bound by {pred.bound}")
    print(f"{'lane':<12}{'busy s':>10}{'exposed s':>11}")
    for lane, seconds in pred.busy.items():
        exposed = pred.exposed.get(lane)
        print(f"{lane:<12}{seconds:>10.3f}{'' if exposed is None else f'{exposed:.3f}':>11}")
    if args.trace:
        pred.trace.save(args.trace)
        print(f"wrote {args.trace} (open it in ui.perfetto.dev)")
    return 0


def add_step_parser(commands) -> argparse.ArgumentParser:
    from . import profiles

    st = commands.add_parser("step", help="predict a step's time, bound resource and exposed time",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--params", type=parse_count, default=7e9, help="model size, e.g. 7B or 124M")
    st.add_argument("--tokens", type=int, default=8 * 4096, help="tokens per optimizer step (batch x sequence)")
    st.add_argument("--hardware", choices=[*profiles.PRESETS, "probe"], default="h100-sxm",
                    help="a preset of the hardware table, or 'probe' to measure this machine")
    st.add_argument("--precision", choices=memory.PRECISIONS, default="mixed_bf16")
    st.add_argument("--tensors", type=int, default=291, help="parameter tensors (one copy each way per tensor)")
    st.add_argument("--recompute", action="store_true", help="full activation checkpointing (one more forward)")
    st.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                    help="optimizer offload; --no-offload: everything on the device")
    st.add_argument("--subgroup-numel", type=int, default=1 << 26, help="elements per optimizer subgroup")
    st.add_argument("--delay", action="store_true", help="the one-step delayed update")
    st.add_argument("--gpu-fraction", type=float, default=None, metavar="F", help="hybrid update, static share")
    st.add_argument("--stride", type=int, default=None, metavar="K", help="hybrid update, every K-th subgroup")
    st.add_argument("--nvme", action="store_true", help="optimizer state on NVMe")
    st.add_argument("--clip", action="store_true", help="gradient clipping (a pass over the gradients)")
    st.add_argument("--mfu", type=float, default=0.4, help="model FLOP/s utilisation of forward and backward")
    st.add_argument("--trace", default=None, metavar="FILE", help="save the predicted step as a Perfetto trace")
    st.set_defaults(run=step_command)
    return st


def add_plan_parser(commands) -> argparse.ArgumentParser:
    from . import profiles
    from .models import GPTConfig
    from .plan_types import PLAN_PRECISIONS

    pl = commands.add_parser("plan", help="search the runtime's configurations for a model and a machine; print the "
                             "best, why the others lose, and write the chosen plan as JSON",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = pl.add_mutually_exclusive_group()
    what.add_argument("--params", type=parse_count, default=None, help="a GPT-3-family model of this size, e.g. 70B")
    what.add_argument("--model", choices=GPTConfig.preset_names(), default=None,
                      help="a course GPT (its plan runs with `train --plan`)")
    pl.add_argument("--seq-len", type=int, default=None, help="context length (default: 2048, or the preset's)")
    pl.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (micro-batch x accumulation)")
    pl.add_argument("--hardware", default="h100-sxm",
                    help=f"a preset ({', '.join([*profiles.PRESETS, *profiles.PAPER_PRESETS])}) or 'sim' (this "
                         "machine's simulated device, measured)")
    pl.add_argument("--device-memory", type=_bytes, default=None, metavar="SIZE",
                    help="device memory to plan for (default: the profile's; the sim's 4 GiB)")
    pl.add_argument("--host-gb", type=float, default=None, help="host memory for pinned buffers, GB (default: the "
                    "profile's share of the host)")
    pl.add_argument("--nvme-gb", type=float, default=None, help="NVMe space, GB (default: unbounded; 0: no NVMe)")
    pl.add_argument("--precision", choices=PLAN_PRECISIONS, default=None,
                    help="default: mixed_bf16, or fp32 for a course GPT")
    pl.add_argument("--mfu", type=float, default=0.4, help="model FLOP/s utilisation of forward and backward")
    pl.add_argument("--top", type=int, default=6, help="plans to show, one per kind of configuration")
    pl.add_argument("--out", default="plan.json", metavar="FILE", help="where the chosen plan goes")
    pl.add_argument("--export", default=None, metavar="DIR",
                    help="also write the chosen plan for other systems: DIR/deepspeed.json, DIR/fsdp2_plan.py, "
                         "DIR/torchao_plan.py, each listing what that system cannot express")
    pl.set_defaults(run=plan_command)
    return pl


def plan_command(args: argparse.Namespace) -> int:
    from . import plan as planner

    hw, spec, limits = args.hardware_profile, args.spec, args.limits
    capacity = limits.capacity(hw)
    print(f"{spec} on {hw.name}, {limits.batch} sequences per step, {limits.precision}")
    print("memory: " + ", ".join(f"{t} {memory.format_bytes(v)}" if v is not None else f"{t} unbounded"
                                 for t, v in capacity.items()) + "\n")
    plans = planner.search(spec, hw, limits)
    shown = planner.best_per_family(plans)[:args.top]
    print(planner.table(shown))
    best = plans[0]
    print(f"\nchosen: {best.describe()}; subgroups of {best.subgroup_numel:,} elements; activations by block: "
          f"{best.activations_line()}")
    if len(shown) > 1:
        print("the others lose:")
        for i, other in enumerate(shown[1:], 2):
            print(f"  #{i}: {planner.why_slower(best, other)}")
    print(f"\nwrote {best.save(args.out)} ({len(plans)} configurations fit); run a course GPT's plan with "
          f"`python -m minioffload train --plan {args.out}`")
    if args.export:
        import json
        from pathlib import Path

        from . import export

        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        (out / "deepspeed.json").write_text(json.dumps(export.to_deepspeed_config(best), indent=2) + "\n")
        (out / "fsdp2_plan.py").write_text(export.to_fsdp2_code(best))
        (out / "torchao_plan.py").write_text(export.to_torchao_code(best))
        for system in ("deepspeed", "fsdp2", "torchao"):
            gaps = export.unsupported(best, system)
            print(f"{system}: {len(gaps)} choice(s) it cannot express" + (f" (first: {gaps[0]})" if gaps else ""))
        print(f"wrote {out}/deepspeed.json, fsdp2_plan.py, torchao_plan.py")
    return 0


def add_train_parser(commands) -> argparse.ArgumentParser:
    from . import options
    from .models import GPTConfig
    from .train import DEVICES, PARAMS_ON, PRECISIONS, TrainConfig

    d = TrainConfig()
    tr = commands.add_parser("train", help="train a small GPT with offloaded AdamW and print the step-time split",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("--device", choices=DEVICES, default=d.device, help="where the model runs")
    tr.add_argument("--model", choices=GPTConfig.preset_names(), default=d.model, help="GPT size preset")
    tr.add_argument("--block-size", type=int, default=d.block_size, help="context length in characters")
    tr.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    tr.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    tr.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    tr.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                    help="the model's parameter dtype (optimizer state stays fp32)")
    tr.add_argument("--offload", action=argparse.BooleanOptionalAction, default=d.offload,
                    help="OffloadAdam with state in pinned host memory; --no-offload: torch AdamW on the device")
    tr.add_argument("--activations", default=d.activations, metavar="POLICY",
                    help="what each block keeps for backward: keep, recompute, selective, offload or offload_input; "
                         "one for every block, or one per block separated by commas")
    tr.add_argument("--params-on", choices=PARAMS_ON, default=d.params_on,
                    help="where the blocks' weights live: on the device, or streamed block by block from pinned host "
                         "memory or from NVMe (DIR/weights of --nvme-dir): chapter 8")
    tr.add_argument("--prefetch", type=int, default=d.prefetch, help="streamed weights: blocks fetched ahead")
    tr.add_argument("--device-memory", type=_bytes, default=d.device_memory, metavar="SIZE",
                    help="the sim device's memory, e.g. 64MB or 1GiB (default 4 GiB)")
    tr.add_argument("--nvme-dir", default=d.nvme_dir, metavar="DIR",
                    help="keep the optimizer state in files in DIR (on an NVMe drive): chapter 6's tier")
    tr.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    tr.add_argument("--seed", type=int, default=d.seed, help="seeds the model, the batches and the sample")
    tr.add_argument("--out-dir", default=d.out_dir, help="where trace.json, loss.csv, summary.json go; "
                    "None: runs/<timestamp>")
    tr.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation losses")
    tr.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                    help="show a progress bar with loss and tokens/s")
    tr.add_argument("--plan", default=None, metavar="FILE",
                    help="run a plan written by `plan`: it sets the model, context, batch, accumulation, precision, "
                         "offload, activations, homes, prefetch and optimizer options")
    options.add_flags(tr, d.optimizer)  # one flag per OffloadOptions field
    tr.set_defaults(run=train_command)
    return tr


def train_command(args: argparse.Namespace) -> int:
    from .train import format_summary, train

    result = train(args.config)
    print(format_summary(result.summary))
    print(f"wrote {result.paths['trace']}, {result.paths['loss'].name}, {result.paths['summary'].name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minioffload", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback when a command fails (or set MINIOFFLOAD_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    fp = commands.add_parser("footprint", help="bytes per parameter and per tier, and whether it fits")
    fp.add_argument("--params", type=parse_count, default=7e9,
                    help="model size, e.g. 7B or 124M (default 7B)")
    fp.add_argument("--precision", choices=memory.PRECISIONS, default="mixed_bf16")
    fp.add_argument("--optimizer", choices=memory.OPTIMIZERS, default="adam")
    fp.add_argument("--placement", choices=memory.PLACEMENTS, default="device")
    fp.add_argument("--gpu-gb", type=float, default=None,
                    help="GPU memory in GB as sold (default: the --hardware preset's)")
    fp.add_argument("--hardware", default="h100-sxm", help="hardware preset whose GPU memory to check against")
    fp.add_argument("--delay", action="store_true", help="count the delayed update's upload buffers")
    fp.set_defaults(run=footprint_command)
    hw = commands.add_parser("hardware", help="the hardware table: presets with their sources, or this machine")
    hw.add_argument("name", nargs="?", default=None, help="one preset: every figure with its source")
    hw.add_argument("--probe", action="store_true", help="measure this machine (about 5 s)")
    hw.set_defaults(run=hardware_command)
    st = add_step_parser(commands)
    pl = add_plan_parser(commands)
    tr = add_train_parser(commands)
    from .doctor import add_doctor_parser

    add_doctor_parser(commands)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("MINIOFFLOAD_DEBUG") == "1"
    if args.command == "footprint":
        from . import profiles

        if args.gpu_gb is None:
            try:
                args.gpu_gb = profiles.preset(args.hardware).device_memory / memory.GB
            except ValueError as err:
                fp.error(str(err))
        if not 0 < args.gpu_gb < math.inf:
            fp.error(f"--gpu-gb must be a positive number of GB, got {args.gpu_gb}")
        if args.delay and args.placement != "optimizer_cpu":
            fp.error("--delay counts the delayed update's buffers, which exist with --placement optimizer_cpu only")
    if args.command == "hardware" and args.name is not None:
        from . import profiles

        if args.name not in profiles.PRESETS:
            hw.error(f"unknown hardware preset {args.name!r}; choose one of {', '.join(profiles.PRESETS)}")
    if args.command == "step":
        from . import options, stepmodel

        try:  # checked before anything is measured or printed
            args.work = stepmodel.Workload(int(args.params), args.tokens, args.precision, args.tensors,
                                           args.recompute)
            args.step_config = stepmodel.StepConfig(
                offload=args.offload, subgroup_numel=args.subgroup_numel, delay=args.delay,
                gpu_fraction=args.gpu_fraction, stride=args.stride, nvme=args.nvme, clip=args.clip, mfu=args.mfu)
        except ValueError as err:  # name the flag, not the field
            message = options.name_flags(str(err))
            for field, flag in (("num_params", "--params"), ("num_tensors", "--tensors"), ("tokens", "--tokens"),
                                ("mfu", "--mfu")):
                message = re.sub(rf"^{field}\b", flag, message)
            st.error(message)
    if args.command == "plan":
        _check_plan_args(args, pl)
    if args.command == "train":
        from . import options
        from .train import TrainConfig, preflight

        option_names = {f.name for f in dataclasses.fields(options.OffloadOptions)}
        fields = {k: v for k, v in vars(args).items() if k not in ("command", "run", "debug", "plan", *option_names)}
        try:
            if args.plan is not None:
                args.config = _planned_config(args, tr, fields)
            else:
                args.config = TrainConfig(**fields, optimizer=options.from_flags(args))
            # the device, the context length, the directories: refused before anything runs; the run then writes
            # where the check looked
            args.config.out_dir = str(preflight(args.config)[0])
        except ValueError as err:  # name the flag, not the field
            message = re.sub(r"TrainConfig\.(\w+)", lambda m: options.flag(m[1]), options.name_flags(str(err)))
            listed = re.match(r"TrainConfig: ([\w, -]+): ", message)  # "TrainConfig: a, b: OffloadAdam's options"
            if listed:
                names = ", ".join(options.flag(n) if n in fields else n for n in listed[1].split(", "))
                message = f"{names}: {message[listed.end():]}".replace("offload=True", "--offload")
            tr.error(message)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"python -m minioffload {args.command}: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError, MemoryError) as err:  # a failed run: one message, no traceback
        if debug:
            raise
        print(f"python -m minioffload {args.command}: error: {err}\n(python -m minioffload --debug "
              f"{args.command} ... shows the traceback)", file=sys.stderr)
        return 1


def _check_plan_args(args: argparse.Namespace, pl: argparse.ArgumentParser) -> None:
    """The plan command's inputs, refused before anything is measured or searched."""
    from . import plan as planner
    from . import profiles

    if args.hardware == "sim":
        hw = None  # measured below, once the rest is known to be right
    else:
        try:
            hw = profiles.preset(args.hardware)
        except ValueError as err:
            pl.error(f"--hardware: {err}; or 'sim' for this machine")
    for flag, value in (("--host-gb", args.host_gb), ("--nvme-gb", args.nvme_gb)):
        if value is not None and not 0 <= value < math.inf:
            pl.error(f"{flag} must be a number of GB >= 0, got {value}")
    if args.host_gb == 0:
        pl.error("--host-gb 0 leaves no host memory: every configuration needs some; give the GB it may use")
    if args.top < 1:
        pl.error(f"--top must be at least 1, got {args.top}")
    try:
        if args.model is not None:
            args.spec = planner.ModelSpec.of_preset(args.model, args.seq_len)
        else:
            args.spec = planner.ModelSpec.of_params(args.params or 7e9, args.seq_len or 2048)
        precision = args.precision or ("fp32" if args.model else "mixed_bf16")
        args.limits = planner.Limits(
            batch=args.batch, device_bytes=args.device_memory, precision=precision, mfu=args.mfu,
            host_bytes=None if args.host_gb is None else args.host_gb * memory.GB,
            nvme_bytes=None if args.nvme_gb is None else args.nvme_gb * memory.GB)
    except ValueError as err:
        pl.error(re.sub(r"^(batch|mfu|precision)\b", lambda m: "--" + m[1], str(err)))
    if hw is None:
        from .device_sim import SimDevice

        hw = profiles.probe()
        if args.device_memory is None:  # the sim device's own memory, not the host's
            args.limits = dataclasses.replace(args.limits, device_bytes=SimDevice.DEFAULT_MEMORY)
    args.hardware_profile = hw


def _planned_config(args: argparse.Namespace, tr: argparse.ArgumentParser, fields: dict):
    """`train --plan FILE`: the plan's configuration, with the flags the plan does not set."""
    from . import options
    from . import plan as planner
    from .train import TrainConfig

    try:
        plan = planner.Plan.load(args.plan)
    except ValueError as err:
        tr.error(f"--plan: {err}")
    planned = ("model", "block_size", "batch_size", "grad_accum", "precision", "offload", "activations", "params_on",
               "prefetch")
    defaults = TrainConfig()
    clash = [name for name in planned if fields[name] != getattr(defaults, name)]
    if options.from_flags(args) != defaults.optimizer:
        clash.append("optimizer options (--subgroup-numel, --gpu-fraction, ...)")
    if clash:
        flags = [n if n.startswith("optimizer") else "--" + n.replace("_", "-") for n in clash]
        tr.error(f"{', '.join(flags)}: set by --plan {args.plan}; drop the flag, or make another plan")
    rest = {k: v for k, v in fields.items() if k not in planned}
    if rest["device_memory"] is None and plan.capacity.get("device") and plan.hardware.endswith("(sim)"):
        rest["device_memory"] = int(plan.capacity["device"])  # the sim device the plan was made for
    return planner.train_config(plan, **rest)


if __name__ == "__main__":
    sys.exit(main())
