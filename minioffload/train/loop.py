"""The training loop behind `python -m minioffload train`: a small GPT on the bundled text, with its AdamW
state offloaded to pinned host memory (OffloadAdam) or kept on the device (torch AdamW, the baseline).

    result = train(TrainConfig(device="sim", steps=50, out_dir="runs/demo"))
    result.losses          # train loss per step
    result.summary         # the step-time split, memory, final losses and a sample (also summary.json)

One step: `grad_accum` micro-batches of forward ("forward" span on lane "compute") and backward ("backward"),
then the optimizer step (OffloadAdam records its own d2h / cpu / h2d spans; the baseline one "update" span on
"compute"). The summary splits the mean step time into forward, backward, exposed D2H (the d2h lane busy
while neither compute nor cpu is), CPU update (cpu lane busy), exposed H2D (likewise) and device update,
measured from `dev.trace` inside each step's window. The first step (Numba compiles the CPU Adam, caches
warm up) is left out of the means when there is more than one.

Writes out_dir/trace.json (Perfetto), loss.csv and summary.json.

On a GPU the host runs ahead of the device through a step's micro-batches: each goes up from a pinned buffer on a copy
stream (train/batches.py; the sim's compute reads the drawn tensors as they are), and the loss is read once per step,
after the update is queued, never per micro-batch.

With `params_on="host"` or `"nvme"` the blocks' weights are streamed (chapter 8, model/streaming.py): they live in
pinned host memory or on NVMe (weights_dir, or nvme_dir/weights beside the optimizer's state) and come up block by
block, `prefetch` blocks ahead, so a model several times the (sim) device's `device_memory` trains.

With `host_budget`, the run's pinned host memory is counted before it starts (train/host_budget.py), refused when
the count passes the budget, and held to the budget as it runs (pinned.HostBudget); the summary reports the
measured peak.

With `shard=True`, under torchrun (`torchrun --nproc-per-node N -m minioffload train --shard`), each rank is one
process with its own device (the sim, or GPU LOCAL_RANK) and OffloadAdam shards the optimizer state (chapter 10,
engine/sharding.py). Rank r trains on micro-batches r*A .. r*A+A-1 of the N*A one process with grad_accum N*A would
draw, so N ranks give that one process's weights. Rank 0 writes loss.csv, summary.json (with every rank's link
bytes) and trace.json; rank r > 0 writes trace_rank<r>.json. `checkpoint_dir` saves the run at its end with
torch.distributed.checkpoint (train/checkpoint.py); `resume` continues one, on any number of ranks.

What this is not: a tuned trainer (no LR schedule, no mixed-precision autocast: "bf16"
casts the model's parameters, and OffloadAdam keeps fp32 masters on the host).
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from ..devices import device as make_device
from ..devices.sim import SimDevice
from ..engine import sharding
from ..engine.optimizer import OffloadAdam
from ..layout import STATE_BYTES_PER_PARAM
from ..model.activations import Activations
from ..model.gpt import GPT, CharTokenizer, GPTConfig, batches, load_text, train_val_split
from ..model.streaming import ParamStreamer, plan
from ..nvme.swapper import Swapper
from ..paths import usable_directory
from ..pinned import HostBudget
from . import checkpoint, checkpoint_async, host_budget
from .batches import BatchUploads
from .config import DEVICES, PRECISIONS, TrainConfig  # noqa: F401 (DEVICES, PRECISIONS: the CLI's choices)
from .report import PHASES, format_summary, step_phases, summarize

__all__ = ["PHASES", "TrainConfig", "TrainResult", "format_summary", "preflight", "step_phases", "train"]
EVAL_BATCHES = 8  # validation batches per evaluation (the same ones every time)


@dataclass
class TrainResult:
    losses: list[float]  # mean train loss of each step
    val_losses: dict[int, float]  # step -> validation loss
    summary: dict
    out_dir: Path
    paths: dict[str, Path] = field(default_factory=dict)  # "trace", "loss", "summary" -> file


# ---------------------------------------------------------------------------------------------
# the loop


class _Steps(list):
    """The steps without a progress bar (tqdm not installed, or progress=False): tqdm's methods, doing nothing."""

    def set_postfix(self, **values) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(steps: int, desc: str, enabled: bool, first: int = 1):
    try:
        from tqdm.auto import tqdm  # the course extra installs it; the runtime runs without
    except ImportError:
        enabled = False
    if not enabled:
        return _Steps(range(first, steps + 1))
    return tqdm(range(first, steps + 1), desc=desc, unit="step", dynamic_ncols=True)


@torch.no_grad()
def _val_loss(model: GPT, val_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    try:
        return sum(float(model(x, y)[1]) for x, y in val_batches) / len(val_batches)
    finally:
        model.train(was_training)


def _mean_loss(losses: list[torch.Tensor]) -> float:
    """The mean of the micro-batches' losses, read from the device in one copy (one wait for it per step). The sum
    is taken on the host, in float64 and in order, as `float(loss) / n` added one by one always was, so the loop's
    numbers do not change (a sum on the device, in the loss's dtype, would round differently)."""
    total = 0.0
    for value in torch.stack(losses).tolist():
        total += value / len(losses)
    return total


def config_layers(config: TrainConfig) -> int:
    return GPTConfig.preset(config.model, 1, block_size=config.block_size).n_layer


def preflight(config: TrainConfig) -> tuple[Path, CharTokenizer, torch.Tensor, torch.Tensor]:
    """What a run needs, checked before any work starts (ValueError naming the setting and the fix): the
    device, a context that fits the validation split, and directories it can write, with room for the NVMe
    tier's files. Changes nothing. Returns the out_dir (to make), the tokenizer and the train and validation tokens."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device='cuda' needs a CUDA GPU and a CUDA build of torch (this torch sees "
                         "none); use device='sim' to run on the CPU")
    text = load_text()
    tok = CharTokenizer(text)
    train_tokens, val_tokens = train_val_split(torch.tensor(tok.encode(text)))
    if config.block_size >= len(val_tokens):
        raise ValueError(f"TrainConfig.block_size={config.block_size} leaves no window in the {len(val_tokens)}"
                         f"-token validation split; use a block_size below {len(val_tokens)}")
    names = config.activations.split(",")
    if len(names) > 1 and len(names) != config_layers(config):
        raise ValueError(f"TrainConfig.activations lists {len(names)} policies and the {config.model} model has "
                         f"{config_layers(config)} blocks: give one per block, or one for all")
    out_dir = usable_directory(config.out_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"),
                               "TrainConfig.out_dir")
    with torch.device("meta"):  # sizes only: nothing allocated
        shape = GPT(GPTConfig.preset(config.model, tok.vocab_size, block_size=config.block_size))
    on_sim = config.device == "sim" or (config.device == "auto" and not torch.cuda.is_available())
    if config.params_on != "device" and on_sim:  # the sim's memory is known before it exists
        if config.precision == "bf16":
            shape.to(torch.bfloat16)
        plan(shape, config.prefetch, None, config.device_memory or SimDevice.DEFAULT_MEMORY)
    if config.host_budget is not None:
        host_budget.refuse_over_budget(config, host_budget.pinned_need(config, shape, on_sim))
    params = shape.num_params()
    # two versions of 12 B/param (master, exp_avg, exp_avg_sq), as the swapper keeps them, and of the weights
    weights = 2 * (2 if config.precision == "bf16" else 4) * params if config.params_on == "nvme" else 0
    if config.weights_dir is not None:
        usable_directory(config.weights_dir, "TrainConfig.weights_dir", need_bytes=weights)
        weights = 0
    if config.nvme_dir is not None:
        usable_directory(config.nvme_dir, "TrainConfig.nvme_dir",
                         need_bytes=2 * STATE_BYTES_PER_PARAM * params + weights)
    return out_dir, tok, train_tokens, val_tokens


def train(config: TrainConfig) -> TrainResult:
    """Train a GPT as `config` says; write trace.json, loss.csv and summary.json into its out_dir."""
    out_dir, tok, train_tokens, val_tokens = preflight(config)
    lazy = config.resume is not None and bool(checkpoint_async.complete(Path(config.resume)))
    if config.resume is not None and not lazy and checkpoint.committed(config.resume) is None:
        raise ValueError(f"TrainConfig.resume={config.resume!r} holds no checkpoint (no .metadata, no step "
                         "directory with a MANIFEST.json): give a directory a run saved with checkpoint_dir")
    shard = _join(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig.preset(config.model, tok.vocab_size, block_size=config.block_size))
    options = {} if config.device_memory is None else {"memory_bytes": config.device_memory}
    if shard is not None and _on_cuda(config):
        options = {"index": int(os.environ.get("LOCAL_RANK", 0))}
    dev = make_device(config.device, **options)
    finished = False
    try:
        with HostBudget(config.host_budget) as pinned:  # no budget: the peak is still measured
            result = _run(config, dev, model, tok, train_tokens, val_tokens, out_dir, shard, pinned)
        finished = True
        return result
    finally:
        dev.close()
        if shard is not None:
            sharding.leave(wait_for_all=finished)  # after an error the other ranks may never reach the barrier


def _on_cuda(config: TrainConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def _join(config: TrainConfig):
    """shard=True: join torchrun's process group (gloo for the sim, NCCL for CUDA); a Shard, else None."""
    if not config.shard:
        return None
    if "WORLD_SIZE" not in os.environ:
        raise ValueError("TrainConfig.shard needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR): run "
                         "`torchrun --nproc-per-node N -m minioffload train --shard ...`")
    if _on_cuda(config):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # NCCL's communicators use the current device
    sharding.init("cuda" if _on_cuda(config) else "sim")
    return sharding.Shard()


def _run(config, dev, model, tok, train_tokens, val_tokens, out_dir, shard=None, pinned=None) -> TrainResult:
    if config.precision == "bf16":
        model.to(torch.bfloat16)
    swapper = weights_home = streamer = None
    rank, world = (shard.rank, shard.world) if shard is not None else (0, 1)
    if config.nvme_dir is not None:  # each rank its own files
        nvme_dir = Path(config.nvme_dir) / f"rank{rank}" if shard is not None else Path(config.nvme_dir)
        nvme_dir.mkdir(parents=True, exist_ok=True)  # preflight checked that it can be made
        swapper = Swapper(nvme_dir)
    if config.params_on == "device":
        dev.place(model)
    else:  # the blocks' weights stay home and come up block by block; the rest is placed
        if config.params_on == "nvme":  # sharded: each rank its own copy
            if config.weights_dir is not None:
                weights_dir = Path(config.weights_dir) / (f"rank{rank}" if shard is not None else "")
            else:  # beside the optimizer's state
                weights_dir = (nvme_dir if shard is not None else Path(config.nvme_dir)) / "weights"
            weights_dir.mkdir(parents=True, exist_ok=True)
            weights_home = Swapper(weights_dir)
        streamer = ParamStreamer(model, dev, prefetch=config.prefetch, home=config.params_on,
                                 swapper=weights_home)
    names = config.activations.split(",")
    Activations(model.blocks, names[0] if len(names) == 1 else names, dev)  # "keep": nothing changes
    params = list(model.parameters())
    if config.offload:
        options = config.optimizer  # a speculative update starts during the step's last micro-batch
        options = options.replace(backwards_per_step=config.grad_accum) if options.speculative else options
        opt = OffloadAdam(params, dev, lr=config.lr, options=options, swapper=swapper, streamer=streamer,
                          shard=shard, grads_on=config.grads_on)
    else:
        if config.precision == "bf16":
            warnings.warn("precision='bf16' with offload=False: torch AdamW updates the bf16 weights directly "
                          "(no fp32 master copy), so small updates round away", stacklevel=3)
        opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.01)  # OffloadAdam's default decay
    data_gen = torch.Generator().manual_seed(config.seed)
    val_gen = torch.Generator().manual_seed(config.seed + 1)
    val_batches = [tuple(map(dev.to_device, batches(val_tokens, config.block_size, config.batch_size, val_gen)))
                   for _ in range(EVAL_BATCHES)]
    tokens_per_step = config.batch_size * config.block_size * config.grad_accum * world
    first_step = 1
    if config.resume is not None:
        if checkpoint_async.complete(Path(config.resume)):  # lazy async checkpoints: the newest complete one
            extra = checkpoint_async.load_latest(config.resume, model, opt)[1]
        else:
            extra = checkpoint.load(config.resume, model, opt)
        first_step = extra["step"] + 1
        if first_step > config.steps:
            raise ValueError(f"TrainConfig.resume: the checkpoint is at step {extra['step']}; set steps above it "
                             "(steps counts from the start of the run)")
        data_gen.set_state(torch.tensor(list(extra["data_rng"]), dtype=torch.uint8))

    losses: list[float] = []
    val_losses: dict[int, float] = {}
    rows: list[tuple] = []
    windows: list[tuple[int, int, float, float]] = []  # (first span index, last, start, end) per step
    state_adopted = False
    bar = _progress_bar(config.steps, f"train {config.model} ({dev.kind}{f', {world} ranks' if shard else ''})",
                        config.progress and rank == 0, first_step)
    lazy_writer = None
    if config.checkpoint_every is not None:
        lazy_writer = checkpoint_async.AsyncCheckpointer(config.checkpoint_dir, model, opt)
    uploads = BatchUploads(dev, config.grad_accum)  # pinned, copied up on a stream (the sim: used as drawn)
    dev.synchronize()
    for step in bar:
        first_span, start = len(dev.trace.spans), dev.trace.now()
        drawn = [batches(train_tokens, config.block_size, config.batch_size, data_gen)
                 for _ in range(config.grad_accum * world)]  # every rank draws all, and trains on its own
        uploads.send(drawn[rank * config.grad_accum:(rank + 1) * config.grad_accum])
        micro_losses = []  # on the device: read once, at the step's end, so the host never waits for a forward
        for micro in range(config.grad_accum):
            x, y = uploads.get(micro)
            _, loss = dev.timed("forward", lambda x=x, y=y: model(x, y))
            dev.timed("backward", lambda loss=loss: (loss / config.grad_accum).backward())
            micro_losses.append(loss.detach())
            if not config.offload and micro == config.grad_accum - 1:
                for p in params:  # the baseline holds its gradients on the device: count them
                    if p.grad is not None:
                        dev.adopt(p.grad, "grad")
        if config.offload:
            opt.step()  # records its own d2h / cpu / h2d spans
        else:
            def update():
                if config.optimizer.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, config.optimizer.max_grad_norm)
                opt.step()
            dev.timed("update", update)
            if not state_adopted:  # AdamW made its exp_avg / exp_avg_sq on the device: count them
                for state in opt.state.values():
                    for t in state.values():
                        if torch.is_tensor(t) and t.numel() > 1:
                            dev.adopt(t, "optimizer state")
                state_adopted = True
        opt.zero_grad(set_to_none=True)
        if lazy_writer is not None and (step % config.checkpoint_every == 0 or step == config.steps):
            lazy_writer.save(step, extra={"step": step, "data_rng": bytes(data_gen.get_state().tolist())})
        step_loss = _mean_loss(micro_losses)
        if shard is not None:
            step_loss = shard.mean(step_loss)
        if step == config.steps and isinstance(opt, OffloadAdam):
            opt.flush()  # a delayed update's last weights: evaluate and sample with them
        dev.synchronize()  # the step ends when its last copy has landed (the next forward waits for it)
        end = dev.trace.now()
        windows.append((first_span, len(dev.trace.spans), start, end))
        tokens_per_s = tokens_per_step / (end - start)
        losses.append(step_loss)
        val = None
        if step % config.eval_every == 0 or step == config.steps:
            val = val_losses[step] = _val_loss(model, val_batches)
        rows.append((step, step_loss, val, tokens_per_s))
        bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                        **({"val": f"{val:.3f}"} if val is not None else {}))
    bar.close()

    if lazy_writer is not None:
        lazy_writer.close()  # the last one is complete
    elif config.checkpoint_dir is not None:
        checkpoint.save(config.checkpoint_dir, model, opt,
                        extra={"step": config.steps, "data_rng": bytes(data_gen.get_state().tolist())})
    summary = summarize(config, dev, model, tok, opt, windows, losses, val_losses, tokens_per_step, streamer, shard,
                        pinned)
    if isinstance(opt, OffloadAdam):
        opt.close()  # its hooks off the parameters: once the run's references go, so do its buffers
    for disk in (swapper, weights_home):
        if disk is not None:
            disk.close()  # every queued write lands first
    if rank > 0:  # the other ranks write their timeline only
        return TrainResult(losses, val_losses, summary, out_dir,
                           {"trace": dev.trace.save(out_dir / f"trace_rank{rank}.json")})
    paths = {"trace": dev.trace.save(out_dir / "trace.json"), "loss": out_dir / "loss.csv",
             "summary": out_dir / "summary.json"}
    with open(paths["loss"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "train_loss", "val_loss", "tokens_per_s"])
        for step, loss, val, tps in rows:
            writer.writerow([step, f"{loss:.6f}", "" if val is None else f"{val:.6f}", f"{tps:.1f}"])
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    return TrainResult(losses, val_losses, summary, out_dir, paths)
