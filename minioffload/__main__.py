"""Command line: `python -m minioffload COMMAND ...`.

Commands so far:
    footprint   bytes per parameter and per tier for a model size, precision, optimizer and placement,
                and whether it fits a GPU (chapter 1's calculator)

Later chapters add `train`, `probe` and `plan`.
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
    args = parser.parse_args(argv)
    if args.command == "footprint" and not args.gpu_gb > 0:
        parser.error(f"--gpu-gb must be positive, got {args.gpu_gb}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
