"""Command line: `python -m minioffload COMMAND ...`.

Commands so far:
    footprint   bytes per parameter and per tier for a model size, precision, optimizer and placement,
                and whether it fits a GPU (chapter 1's calculator)
    train       train a small GPT with its optimizer state offloaded to the host (or the on-device
                baseline) and print where the step time goes (minioffload/train/loop.py)
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

from ..predict import memory
from . import plan as plan_cli
from .args import bytes_arg, parse_count

# the Placement fields train's flags set (the others: --offload, ...)
TRAIN_PLACEMENT = ("params_on", "prefetch", "grads_on")
# the settings' "optimizer_on='device' (train: offload=False)": train's flag for it
TRAIN_FLAGS = {"offload=False": "--no-offload", "offload=True": "--offload", "nvme_dir": "--nvme-dir",
               "no nvme_dir": "no --nvme-dir", "weights_dir": "--weights-dir", "shard": "--shard"}
TRAIN_SPELLING = re.compile(r"\S+ \(train: ([^)]*)\)")


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
    from ..machine import profiles

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
    from ..machine import profiles
    from ..predict import stepmodel

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
    from .. import options
    from ..machine import profiles

    st = commands.add_parser("step", help="predict a step's time, bound resource and exposed time",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--params", type=parse_count, default=7e9, help="model size, e.g. 7B or 124M")
    st.add_argument("--tokens", type=int, default=8 * 4096, help="tokens per optimizer step (batch x sequence)")
    st.add_argument("--hardware", choices=[*profiles.PRESETS, "probe"], default="h100-sxm",
                    help="a preset of the hardware table, or 'probe' to measure this machine")
    st.add_argument("--precision", choices=memory.PRECISIONS, default="mixed_bf16")
    st.add_argument("--tensors", type=int, default=291, help="parameter tensors (one copy each way per tensor)")
    st.add_argument("--recompute", action="store_true", help="full activation checkpointing (one more forward)")
    st.add_argument("--mfu", type=float, default=0.4, help="model FLOP/s utilisation of forward and backward")
    st.add_argument("--trace", default=None, metavar="FILE", help="save the predicted step as a Perfetto trace")
    options.add_flags(st, options.Placement())  # --optimizer-on, --params-on, --prefetch, --ranks
    options.add_flags(st)  # one flag per OffloadOptions field, as train has
    st.set_defaults(run=step_command)
    return st


def add_train_parser(commands) -> argparse.ArgumentParser:
    from .. import options
    from ..model.gpt import GPTConfig
    from ..train.loop import DEVICES, PRECISIONS, TrainConfig

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
    tr.add_argument("--device-memory", type=bytes_arg, default=d.device_memory, metavar="SIZE",
                    help="the sim device's memory, e.g. 64MB or 1GiB (default 4 GiB)")
    tr.add_argument("--host-budget", type=bytes_arg, default=d.host_budget, metavar="SIZE",
                    help="pinned host memory the run may hold, e.g. 512MB: refused before it starts when it needs "
                         "more (default: no bound; the summary reports the peak either way)")
    tr.add_argument("--nvme-dir", default=d.nvme_dir, metavar="DIR",
                    help="keep the optimizer state in files in DIR (on an NVMe drive): chapter 6's tier")
    tr.add_argument("--weights-dir", default=None, metavar="DIR",
                    help="with --params-on nvme: the weights' files in DIR (the optimizer's state stays in host memory "
                         "unless --nvme-dir); default: NVME_DIR/weights")
    tr.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    tr.add_argument("--seed", type=int, default=d.seed, help="seeds the model, the batches and the sample")
    tr.add_argument("--out-dir", default=d.out_dir, help="where trace.json, loss.csv, summary.json go; "
                    "None: runs/<timestamp>")
    tr.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation losses")
    tr.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                    help="show a progress bar with loss and tokens/s")
    tr.add_argument("--shard", action="store_true",
                    help="under torchrun: shard the optimizer state over the ranks (gloo on the sim, NCCL on CUDA)")
    tr.add_argument("--checkpoint-dir", default=d.checkpoint_dir, metavar="DIR",
                    help="save the run here at its end (torch.distributed.checkpoint: every rank writes its part)")
    tr.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                    help="with --checkpoint-dir: a lazy asynchronous checkpoint every N steps (chapter 11), written "
                         "while training goes on")
    tr.add_argument("--resume", default=d.resume, metavar="DIR",
                    help="continue a run saved with --checkpoint-dir, on any number of ranks")
    tr.add_argument("--plan", default=None, metavar="FILE",
                    help="run a plan written by `plan`: it sets the model, context, batch, accumulation, precision, "
                         "offload, activations, homes, prefetch and optimizer options")
    # where the weights live (the optimizer's home is --offload and --nvme-dir, its ranks torchrun's)
    options.add_flags(tr, d.placement, TRAIN_PLACEMENT)
    options.add_flags(tr, d.optimizer)  # one flag per OffloadOptions field
    tr.set_defaults(run=train_command)
    return tr


def train_command(args: argparse.Namespace) -> int:
    from ..train.loop import format_summary, train

    result = train(args.config)
    if "summary" not in result.paths:  # a rank other than 0: rank 0 reports
        return 0
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
    pl = plan_cli.add_plan_parser(commands)
    tr = add_train_parser(commands)
    from ..planner.doctor import add_doctor_parser

    add_doctor_parser(commands)
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("MINIOFFLOAD_DEBUG") == "1"
    if args.command == "footprint":
        from ..machine import profiles

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
        from ..machine import profiles

        if args.name not in profiles.PRESETS:
            hw.error(f"unknown hardware preset {args.name!r}; choose one of {', '.join(profiles.PRESETS)}")
    if args.command == "step":
        from .. import options
        from ..predict import stepmodel

        try:  # checked before anything is measured or printed
            args.work = stepmodel.Workload(int(args.params), args.tokens, args.precision, args.tensors,
                                           args.recompute)
            args.step_config = stepmodel.StepConfig(options.from_flags(args, options.Placement),
                                                    options.from_flags(args), args.mfu)
        except ValueError as err:  # name the flag, not the field
            message = options.name_flags(TRAIN_SPELLING.sub(lambda m: m[0].split(" (train: ")[0], str(err)))
            for field, flag in (("num_params", "--params"), ("num_tensors", "--tensors"), ("tokens", "--tokens"),
                                ("mfu", "--mfu")):
                message = re.sub(rf"^{field}\b", flag, message)
            st.error(message)
    if args.command == "plan":
        plan_cli.check_plan_args(args, pl)
    if args.command == "train":
        from .. import options
        from ..train.loop import TrainConfig, preflight

        option_names = {f.name for f in dataclasses.fields(options.OffloadOptions)}
        fields = {k: v for k, v in vars(args).items() if k not in ("command", "run", "debug", "plan", *option_names)}
        try:
            if args.plan is not None:
                args.config = plan_cli.planned_config(args, tr, fields)
            else:
                args.config = TrainConfig(**fields, optimizer=options.from_flags(args))
            # the device, the context length, the directories: refused before anything runs; the run then writes
            # where the check looked
            args.config.out_dir = str(preflight(args.config)[0])
        except ValueError as err:  # name the flag, not the field
            message = TRAIN_SPELLING.sub(lambda m: TRAIN_FLAGS.get(m[1], m[0]), str(err))
            names = (*(f.name for f in dataclasses.fields(options.OffloadOptions)), *TRAIN_PLACEMENT)
            message = re.sub(r"TrainConfig\.(\w+)", lambda m: options.flag(m[1]), options.name_flags(message, names))
            tr.error(message.replace("offload=True", "--offload").replace("offload=False", "--no-offload"))
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


if __name__ == "__main__":
    sys.exit(main())
