"""The `plan` command and `train --plan`: the planner's inputs checked and named by their flags, its table and
choice printed, the chosen plan written (and exported with --export); a saved plan turned into the TrainConfig that
runs it. main() in cli/main.py wires them in.

What this is not: the planner (planner/search.py) nor the training loop (train/loop.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from ..predict import memory
from .args import bytes_arg, parse_count


def add_plan_parser(commands) -> argparse.ArgumentParser:
    from ..machine import profiles
    from ..model.gpt import GPTConfig
    from ..planner.plan import PLAN_PRECISIONS

    pl = commands.add_parser("plan", help="search the runtime's configurations for a model and a machine; print the "
                             "best, why the others lose, and write the chosen plan as JSON",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = pl.add_mutually_exclusive_group()
    what.add_argument("--params", type=parse_count, default=None, help="a GPT-3-family model of this size, e.g. 70B")
    what.add_argument("--model", choices=GPTConfig.preset_names(), default=None,
                      help="a course GPT (its plan runs with `train --plan`)")
    what.add_argument("--hf-config", default=None, metavar="CONFIG.json",
                      help="a Hugging Face model's config.json (model_type gpt2, llama, mistral, qwen2 or bert; no "
                           "transformers needed), e.g. the bundled minioffload/data/llama-3-8b.config.json")
    pl.add_argument("--seq-len", type=int, default=None,
                    help="context length (default: 2048, the preset's, or the config's max_position_embeddings)")
    pl.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (micro-batch x accumulation)")
    pl.add_argument("--hardware", default="h100-sxm",
                    help=f"a preset ({', '.join([*profiles.PRESETS, *profiles.PAPER_PRESETS, *profiles.NODE_PRESETS])})"
                         " or 'sim' (this machine's simulated device, measured)")
    pl.add_argument("--ranks", type=int, default=1, help="processes, one GPU each: the optimizer state sharded over "
                    "them, weights replicated; --batch, --host-gb and --nvme-gb are per rank")
    pl.add_argument("--device-memory", type=bytes_arg, default=None, metavar="SIZE",
                    help="device memory to plan for (default: the profile's; the sim's 4 GiB)")
    pl.add_argument("--host-gb", type=float, default=None, help="host memory for pinned buffers, GB (default: the "
                    "profile's share of the host)")
    pl.add_argument("--nvme-gb", type=float, default=None, help="NVMe space, GB (default: unbounded; 0: no NVMe)")
    pl.add_argument("--precision", choices=PLAN_PRECISIONS, default=None,
                    help="default: mixed_bf16, or fp32 for a course GPT")
    pl.add_argument("--attention", choices=("fused", "unfused"), default="fused",
                    help="fused: one kernel that keeps no attention scores (torch's scaled_dot_product_attention, "
                         "flash attention; the default); unfused: softmax(q k^T) v written out, which keeps them")
    pl.add_argument("--mfu", type=float, default=0.4, help="model FLOP/s utilisation of forward and backward")
    pl.add_argument("--top", type=int, default=6, help="plans to show, one per kind of configuration")
    pl.add_argument("--out", default="plan.json", metavar="FILE", help="where the chosen plan goes")
    pl.add_argument("--export", default=None, metavar="DIR",
                    help="also write the chosen plan for other systems: DIR/deepspeed.json, DIR/fsdp2_plan.py, "
                         "DIR/torchao_plan.py, each listing what that system cannot express (give --lr)")
    pl.add_argument("--lr", type=float, default=None,
                    help="your model's learning rate, for the exported DeepSpeed config (needed with --export)")
    pl.set_defaults(run=plan_command)
    return pl


def plan_command(args: argparse.Namespace) -> int:
    from ..planner import search as planner

    hw, spec, limits = args.hardware_profile, args.spec, args.limits
    capacity = limits.capacity(hw)
    ranks = f" on each of {limits.ranks} ranks" if limits.ranks > 1 else ""
    print(f"{spec} on {hw.name}, {limits.batch} sequences per step{ranks}, {limits.precision}")
    print(("memory per rank: " if limits.ranks > 1 else "memory: ") + ", ".join(
        f"{t} {memory.format_bytes(v)}" if v is not None else f"{t} unbounded" for t, v in capacity.items()) + "\n")
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

        from ..planner import export, export_code

        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        (out / "deepspeed.json").write_text(json.dumps(export.to_deepspeed_config(best, lr=args.lr), indent=2) + "\n")
        (out / "fsdp2_plan.py").write_text(export_code.to_fsdp2_code(best))
        (out / "torchao_plan.py").write_text(export_code.to_torchao_code(best))
        for system in ("deepspeed", "fsdp2", "torchao"):
            gaps = export.unsupported(best, system)
            print(f"{system}: {len(gaps)} choice(s) it cannot express" + (f" (first: {gaps[0]})" if gaps else ""))
        print(f"wrote {out}/deepspeed.json, fsdp2_plan.py, torchao_plan.py")
    return 0


def check_plan_args(args: argparse.Namespace, pl: argparse.ArgumentParser) -> None:
    """The plan command's inputs, refused before anything is measured or searched."""
    from ..machine import profiles
    from ..planner import search as planner

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
    if args.export is not None and args.lr is None:
        pl.error("--export needs --lr, your model's learning rate: the exported DeepSpeed config sets its optimizer "
                 "with it (no default fits every model)")
    if args.lr is not None and not 0 < args.lr < math.inf:
        pl.error(f"--lr must be a positive learning rate, got {args.lr}")
    try:
        if args.hf_config is not None:
            args.spec = spec_of_hf_config(args.hf_config, args.seq_len, pl)
        elif args.model is not None:
            args.spec = planner.ModelSpec.of_preset(args.model, args.seq_len)
        else:
            args.spec = planner.ModelSpec.of_params(args.params or 7e9, args.seq_len or 2048)
        args.spec = dataclasses.replace(args.spec, fused_attention=args.attention == "fused")
        precision = args.precision or ("fp32" if args.model else "mixed_bf16")
        args.limits = planner.Limits(
            batch=args.batch, device_bytes=args.device_memory, precision=precision, mfu=args.mfu, ranks=args.ranks,
            host_bytes=None if args.host_gb is None else args.host_gb * memory.GB,
            nvme_bytes=None if args.nvme_gb is None else args.nvme_gb * memory.GB)
    except ValueError as err:
        pl.error(re.sub(r"^(batch|mfu|precision|ranks)\b", lambda m: "--" + m[1], str(err)))
    if hw is None:
        from ..devices.sim import SimDevice

        hw = profiles.probe()
        if args.device_memory is None:  # the sim device's own memory, not the host's
            args.limits = dataclasses.replace(args.limits, device_bytes=SimDevice.DEFAULT_MEMORY)
    args.hardware_profile = hw


def spec_of_hf_config(path: str, seq_len: int | None, pl: argparse.ArgumentParser):
    """The ModelSpec of the Hugging Face config.json at `path` (ModelSpec.from_config), or the parser's error."""
    import json
    from pathlib import Path

    from ..predict.shapes import ModelSpec

    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        pl.error(f"--hf-config: there is no file {path}: give the path of a model's config.json")
    except IsADirectoryError:
        pl.error(f"--hf-config: {path} is a directory: give the config.json in it")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        pl.error(f"--hf-config: {path} is not JSON ({err}): give a Hugging Face model's config.json")
    if not isinstance(config, dict):
        pl.error(f"--hf-config: {path} holds a JSON {type(config).__name__}, not a config object: give a Hugging "
                 "Face model's config.json")
    try:
        return ModelSpec.from_config(config, seq_len)
    except ValueError as err:
        pl.error(f"--hf-config {path}: {err}")


def planned_config(args: argparse.Namespace, tr: argparse.ArgumentParser, fields: dict):
    """`train --plan FILE`: the plan's configuration, with the flags the plan does not set."""
    from .. import options
    from ..planner import search as planner
    from ..train.loop import TrainConfig

    try:
        plan = planner.Plan.load(args.plan)
    except ValueError as err:
        tr.error(f"--plan: {err}")
    planned = ("model", "block_size", "batch_size", "grad_accum", "precision", "offload", "activations", "params_on",
               "prefetch", "grads_on")
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
    return plan.train_config(**rest)
