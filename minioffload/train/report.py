"""What a training run reports: the step's phases measured from the trace, the summary, and its table.

    phases = step_phases(dev.trace.spans, start, end)   # seconds of forward, backward, exposed copies, ...
    summary = summarize(config, dev, model, tok, opt, windows, ...)   # what train() writes to summary.json
    print(format_summary(summary))

What this is not: the loop (train/loop.py) or a model of the step (predict/stepmodel.py predicts; this measures).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..engine.optimizer import OffloadAdam
from ..predict.memory import format_bytes
from ..trace import Span, union_length

SAMPLE_CHARS = 200
PHASES = ("forward", "backward", "exposed_d2h", "cpu_update", "exposed_h2d", "device_update")


def step_phases(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Seconds of each phase among `spans` inside the window [start, end] (trace time).

    exposed_d2h: the d2h lane busy while neither compute nor cpu is (|d2h ∪ busy| - |busy|); same for h2d."""
    def clipped(keep) -> list[tuple[float, float]]:
        return [(max(s.start, start), min(s.end, end)) for s in spans
                if keep(s) and s.end > start and s.start < end]

    busy = clipped(lambda s: s.lane in ("compute", "cpu"))
    d2h, h2d = clipped(lambda s: s.lane == "d2h"), clipped(lambda s: s.lane == "h2d")
    busy_time = union_length(busy)
    return {
        "forward": union_length(clipped(lambda s: s.lane == "compute" and s.name == "forward")),
        "backward": union_length(clipped(lambda s: s.lane == "compute" and s.name == "backward")),
        "exposed_d2h": union_length(busy + d2h) - busy_time,
        "cpu_update": union_length(clipped(lambda s: s.lane == "cpu")),
        "exposed_h2d": union_length(busy + h2d) - busy_time,
        "device_update": union_length(clipped(lambda s: s.lane == "compute" and (
            s.name == "update" or s.name.startswith("device adam")))),
    }


def summarize(config, dev, model, tok, opt, windows, losses, val_losses, tokens_per_step, streamer,
              shard=None, pinned=None) -> dict:
    timed = windows[1:] if len(windows) > 1 else windows  # leave the warm-up step out
    spans = dev.trace.spans
    totals = dict.fromkeys(PHASES, 0.0)
    step_time, durations = 0.0, []
    for first, last, start, end in timed:
        for phase, seconds in step_phases(spans[first:last], start, end).items():
            totals[phase] += seconds
        step_time += end - start
        durations.append(end - start)
    n = len(timed)
    split = {f"{phase}_s": totals[phase] / n for phase in PHASES}
    split["other_s"] = max(0.0, step_time / n - sum(split.values()))  # data, loss.item(), bookkeeping
    split["step_s"] = step_time / n
    split["step_median_s"] = sorted(durations)[n // 2]  # robust to steps stalled by other processes
    split["step_min_s"] = min(durations)  # the step with the fewest stalls: what it costs on a quiet machine
    host_bytes = opt.pinned_bytes() if isinstance(opt, OffloadAdam) else 0
    start_ids = tok.encode("\n") if "\n" in tok.chars else [0]
    idx = dev.to_device(torch.tensor([start_ids], dtype=torch.long))
    generated = model.generate(idx, SAMPLE_CHARS, generator=torch.Generator().manual_seed(config.seed))
    per_step = {lane: sum(s.nbytes for first, last, _, _ in timed for s in spans[first:last] if s.lane == lane) / n
                for lane in ("d2h", "h2d", "net")}
    mine = {"link_bytes_per_step": per_step["d2h"] + per_step["h2d"], "net_bytes_per_step": per_step["net"],
            "optimizer_host_bytes": host_bytes, "step_median_s": split["step_median_s"],
            "cpu_update_s": split["cpu_update_s"], "compute_s": split["forward_s"] + split["backward_s"]}
    ranks = shard.gather(mine) if shard is not None else [mine]
    config_dict = asdict(config)
    config_dict.pop("progress")
    config_dict.update(config_dict.pop("optimizer"))  # one flat record, as the CLI's flags are
    return {
        "config": {**config_dict, "device": dev.kind},
        "num_params": model.num_params(),
        "steps_timed": n,
        **split,
        "tokens_per_s": tokens_per_step / split["step_s"],
        "device_peak_bytes": dev.ledger.peak("device"),
        "optimizer_host_bytes": host_bytes,
        # every pinned host buffer alive at once, measured (pinned.HostBudget), and the run's budget (None: none)
        "host_pinned_peak_bytes": None if pinned is None else pinned.peak, "host_budget": config.host_budget,
        "ranks": len(ranks),
        "per_rank": ranks,  # each rank's link and interconnect bytes per step, optimizer host bytes, median step
        "optimizer_nvme_bytes": 12 * sum(sub.numel for sub in opt.subgroups) if getattr(opt, "nvme", None) else 0,
        **({} if streamer is None else {
            "weights_bytes": (weights := sum(p.numel() * p.element_size() for p in model.parameters())),
            "weights_over_device": weights / dev.ledger.capacity("device"),
            "streamed_peak_bytes": streamer.peak_bytes, "stream_budget_bytes": streamer.budget_bytes,
            "fetches": streamer.fetches, "reorders": streamer.reorders}),
        "final_train_loss": losses[-1],
        "final_val_loss": val_losses[max(val_losses)],
        "best_val_loss": min(val_losses.values()),
        "best_val_step": min(val_losses, key=val_losses.get),
        "sample": tok.decode(generated[0, len(start_ids):].tolist()),
    }


_LABELS = {"forward_s": "forward", "backward_s": "backward", "exposed_d2h_s": "exposed D2H",
           "cpu_update_s": "CPU update", "exposed_h2d_s": "exposed H2D", "device_update_s": "device update",
           "other_s": "other (data, sync, bookkeeping)", "step_s": "step total"}


def _optimizer_words(cfg: dict) -> str:
    if not cfg["offload"]:
        return "AdamW on the device (baseline)"
    if cfg.get("nvme_dir") is None:
        return "OffloadAdam (state on the host)"
    if cfg.get("grads_on") == "nvme":
        return f"OffloadAdam (state and gradients on NVMe, {cfg['grad_buffers']} pinned gradient sets)"
    return "OffloadAdam (state on NVMe)"


def format_summary(summary: dict) -> str:
    """The summary as a small table, for the terminal."""
    cfg = summary["config"]
    step = summary["step_s"]
    delayed = cfg.get("delay_updates_after")
    nvme_bytes = summary.get("optimizer_nvme_bytes", 0)
    on_nvme = f", {format_bytes(nvme_bytes)} on NVMe" if nvme_bytes else ""
    budget = f" of a {format_bytes(summary['host_budget'])} budget" if summary.get("host_budget") else ""
    lines = [f"{cfg['model']} GPT, {summary['num_params']:,} parameters, {cfg['precision']}, "
             f"{_optimizer_words(cfg)}"
             f"{'' if delayed is None else f', updates delayed one step after step {delayed}'}"
             f"{''.join(f', hybrid {k} {cfg[k]}' for k in ('gpu_fraction', 'stride') if cfg.get(k) is not None)}, "
             f"{cfg['device']} device",
             f"mean step time over {summary['steps_timed']} steps (the first step is left out; median "
             f"{summary['step_median_s'] * 1e3:.2f} ms):",
             f"  {'phase':<32}{'ms':>9}{'share':>8}"]
    for key, label in _LABELS.items():
        if key == "device_update_s" and not summary[key] and cfg["offload"]:
            continue
        share = summary[key] / step if step else 0.0
        lines.append(f"  {label:<32}{summary[key] * 1e3:>9.2f}{share:>8.0%}")
    lines += [f"throughput          {summary['tokens_per_s']:,.0f} tokens/s",
              *([f"ranks               {summary['ranks']}, optimizer state sharded: each rank's link carries "
                 f"{', '.join(format_bytes(r['link_bytes_per_step']) for r in summary['per_rank'])} a step, the "
                 f"interconnect {', '.join(format_bytes(r['net_bytes_per_step']) for r in summary['per_rank'])}"]
                if summary.get("ranks", 1) > 1 else []),
              f"device peak memory  {format_bytes(summary['device_peak_bytes'])}",
              f"optimizer on host   {format_bytes(summary['optimizer_host_bytes'])} pinned{on_nvme}",
              *([f"pinned host peak    {format_bytes(summary['host_pinned_peak_bytes'])}{budget}"]
                if summary.get("host_pinned_peak_bytes") is not None else []),
              *([f"weights streamed    from {cfg['params_on']}, {cfg['prefetch']} ahead: "
                 f"{format_bytes(summary['weights_bytes'])} of weights, "
                 f"{summary['weights_over_device']:.1f}x the device's memory; at most "
                 f"{format_bytes(summary['streamed_peak_bytes'])} of them on it"]
                if "weights_bytes" in summary else []),
              f"final loss          train {summary['final_train_loss']:.4f}, val {summary['final_val_loss']:.4f} "
              f"(best val {summary['best_val_loss']:.4f} at step {summary['best_val_step']})",
              f"sample ({len(summary['sample'])} characters):",
              *("  | " + line for line in summary["sample"].split("\n"))]
    return "\n".join(lines)
