"""Command line: `python -m minioffload COMMAND ...`.

Commands so far:
    footprint   bytes per parameter and per tier for a model size, precision, optimizer and placement,
                and whether it fits a GPU (chapter 1's calculator)
    train       train a small GPT with its optimizer state offloaded to the host (or the on-device
                baseline) and print where the step time goes (minioffload/train.py)

Later chapters add `probe` and `plan`.
"""

from __future__ import annotations

import argparse
import re
import sys

from . import memory

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7B' -> 7e9, '124M' -> 1.24e8, '1.5e9' -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", text.lower())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive parameter count; write e.g. 7B, 124M, 1.5e9")
    return float(match[1]) * _SUFFIXES[match[2]]


def footprint_command(args: argparse.Namespace) -> int:
    fp = memory.footprint(args.precision, args.optimizer, args.placement)
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


def parse_grad_norm(text: str) -> float | None:
    """'1.0' -> 1.0; 'none' or 'off' -> None (no clipping)."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 1.0, or 'none' for no clipping") \
            from None


def add_train_parser(commands) -> argparse.ArgumentParser:
    from .models import GPTConfig
    from .train import DEVICES, PRECISIONS, TrainConfig

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
    tr.add_argument("--subgroup-numel", type=int, default=d.subgroup_numel,
                    help="elements per OffloadAdam subgroup")
    tr.add_argument("--min-offload-numel", type=int, default=d.min_offload_numel,
                    help="parameters with fewer elements stay on the device, updated there by torch AdamW")
    tr.add_argument("--delay-updates-after", type=int, default=d.delay_updates_after, metavar="N",
                    help="one-step delayed update (ZeRO-Offload's DPU) after N synchronous steps; "
                         "off when not given")
    tr.add_argument("--gpu-fraction", type=float, default=d.gpu_fraction, metavar="F",
                    help="hybrid update: this share of subgroups keeps its state and update on the device")
    tr.add_argument("--stride", type=int, default=d.stride, metavar="K",
                    help="hybrid update: every K-th subgroup's state visits the device for its update")
    tr.add_argument("--nvme-dir", default=d.nvme_dir, metavar="DIR",
                    help="keep the optimizer state in files in DIR (on an NVMe drive): chapter 6's tier")
    tr.add_argument("--max-grad-norm", type=parse_grad_norm, default=d.max_grad_norm,
                    help="clip gradients to this global norm; 'none' turns clipping off")
    tr.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    tr.add_argument("--seed", type=int, default=d.seed, help="seeds the model, the batches and the sample")
    tr.add_argument("--out-dir", default=d.out_dir, help="where trace.json, loss.csv, summary.json go; "
                    "None: runs/<timestamp>")
    tr.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation losses")
    tr.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                    help="show a progress bar with loss and tokens/s")
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
    commands = parser.add_subparsers(dest="command", required=True)
    fp = commands.add_parser("footprint", help="bytes per parameter and per tier, and whether it fits")
    fp.add_argument("--params", type=parse_count, default=7e9,
                    help="model size, e.g. 7B or 124M (default 7B)")
    fp.add_argument("--precision", choices=memory.PRECISIONS, default="mixed_bf16")
    fp.add_argument("--optimizer", choices=memory.OPTIMIZERS, default="adam")
    fp.add_argument("--placement", choices=memory.PLACEMENTS, default="device")
    fp.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB as sold (default 80)")
    fp.set_defaults(run=footprint_command)
    tr = add_train_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "footprint" and not args.gpu_gb > 0:
        parser.error(f"--gpu-gb must be positive, got {args.gpu_gb}")
    if args.command == "train":
        from .train import TrainConfig

        fields = {k: v for k, v in vars(args).items() if k not in ("command", "run")}
        try:
            args.config = TrainConfig(**fields)
        except ValueError as err:  # name the flag, not the field
            message = str(err)
            for name in fields:
                message = message.replace(f"TrainConfig.{name}", "--" + name.replace("_", "-"))
            tr.error(message)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
