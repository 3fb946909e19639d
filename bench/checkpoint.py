"""How long a checkpoint holds the training loop: a blocking torch.save, torch.distributed.checkpoint's async_save,
and the lazy asynchronous checkpoint (train/checkpoint_async.py), each taken after every step of the same run.

A GPT trains with OffloadAdam (host tier) on the simulated device, or with `--device cuda` on this machine's GPU (its
batches go up from pinned buffers, as the training loop's do; the device tensors a checkpoint holds are snapshotted on
a side stream; --quick there trains the small preset, not the medium one). In each measured round every contender runs
STEPS consecutive steps (forward, backward, step), checkpointing its whole state after each, and then waits for its
last checkpoint; so a checkpoint's writer overlaps its own run's next step, not another contender's. "Blocked" is
the time the loop spent in the checkpoint's calls and waits (the final wait included), per checkpoint:
    blocking torch.save   opt.state_dict() and model.state_dict(), torch.save to one file, fsync
    DCP async_save        the same state handed to dcp.async_save (it stages a copy, then writes in a thread); the
                          next checkpoint waits for the previous one's future
    async (ours)          AsyncCheckpointer.save(): the writer reads the live state; the next step() waits only if
                          it has not finished reading (its `blocked_s`)
Interleaved rounds, medians; `--runs 3` repeats the whole run and takes each figure's median over the runs.

Headline (bench/results/checkpoint.json; checkpoint_cuda.json with --device cuda):
    checkpoint_blocking_fraction   ours blocked / blocking torch.save blocked, per checkpoint (target <= 0.1)
    dcp_async_blocking_fraction    the same for DCP's async_save
    checkpoint_seconds             how long our writer took from save() to the manifest, beside the step it hides under

    python bench/checkpoint.py [--quick] [--runs 3] [--device sim|cuda]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import interleaved, stats, write  # noqa: E402

from minioffload.devices import device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.model import gpt as models  # noqa: E402
from minioffload.nvme.swapper import fsync_path  # noqa: E402
from minioffload.train.batches import BatchUploads  # noqa: E402
from minioffload.train.checkpoint_async import AsyncCheckpointer  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group: as intended
KINDS = ("no checkpoint", "blocking torch.save", "DCP async_save", "async (ours)")
STEPS = 4  # consecutive steps per round, each followed by a checkpoint


def make_run(kind: str, preset: str, batch_size: int, block_size: int, scratch: Path, device_kind: str = "sim"):
    """STEPS training steps each followed by a checkpoint of `kind`, as a function (for `interleaved`); a function
    that closes it all; our checkpointer (None for the others)."""
    text = models.load_text()
    tokenizer = models.CharTokenizer(text)
    data = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    dev = device(device_kind)
    uploads = BatchUploads(dev, 1)  # the sim: the batch as drawn; a GPU: up from a pinned buffer, not blocking
    model = dev.place(models.GPT(models.GPTConfig.preset(preset, tokenizer.vocab_size, block_size=block_size)))
    opt = OffloadAdam(model.parameters(), dev, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    directory = scratch / kind.replace(" ", "_").replace(".", "")
    directory.mkdir()
    ckpt = AsyncCheckpointer(directory, model, opt, keep=1) if kind == "async (ours)" else None
    pending: list = []  # DCP's future of the checkpoint in flight
    step_number = [0]

    def checkpoint() -> None:
        step_number[0] += 1
        if kind == "blocking torch.save":
            path = directory / "state.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            fsync_path(path)
        elif kind == "DCP async_save":
            import torch.distributed.checkpoint as dcp

            if pending:
                pending.pop().result()
            target = directory / f"step{step_number[0]}"
            shutil.rmtree(directory / f"step{step_number[0] - 2}", ignore_errors=True)
            pending.append(dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                          checkpoint_id=str(target)))
        elif kind == "async (ours)":
            ckpt.save(step_number[0])

    def one_round() -> dict:
        blocked_before, blocked, fwd_bwd, update = ckpt.blocked_s if ckpt else 0.0, 0.0, [], []
        start = time.perf_counter()
        for _ in range(STEPS):
            uploads.send([models.batches(data, block_size, batch_size, generator)])
            x, y = uploads.get(0)
            began = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            stepped = time.perf_counter()
            opt.step()  # ours: waits here if the last checkpoint has not captured the state yet
            opt.zero_grad()
            updated = time.perf_counter()
            checkpoint()
            blocked += time.perf_counter() - updated if ckpt is None else 0.0
            fwd_bwd.append(stepped - began)
            update.append(updated - stepped)
        waited = time.perf_counter()
        finish_checkpoint()
        end = time.perf_counter()
        blocked += end - waited if ckpt is None else ckpt.blocked_s - blocked_before + end - waited
        return {"wall_s": (end - start) / STEPS, "blocked_s": blocked / STEPS,
                "fwd_bwd_s": statistics.median(fwd_bwd), "step_s": statistics.median(update)}

    def finish_checkpoint() -> None:
        if ckpt is not None:
            ckpt.wait()
        while pending:
            pending.pop().result()

    def finish() -> None:
        if ckpt is not None:
            ckpt.close()
        finish_checkpoint()
        dev.close()

    return one_round, finish, ckpt


def one_run(rounds: int, preset: str, batch_size: int, block_size: int, device_kind: str = "sim"
            ) -> tuple[list[dict], dict]:
    with common.scratch() as scratch:
        runs, finishes, ours = {}, [], None
        for kind in KINDS:
            runs[kind], finish, ckpt = make_run(kind, preset, batch_size, block_size, Path(scratch), device_kind)
            finishes.append(finish)
            ours = ckpt or ours
        results = interleaved(runs, rounds, warmup=2)
        for finish in finishes:
            finish()
        writer_s = ours.last["total_s"] if ours.last else None
    rows = [{"checkpoint": kind, **{k: stats([m[k] for m in measured]) for k in measured[0]}}
            for kind, measured in results.items()]
    blocked = {row["checkpoint"]: row["blocked_s"]["median"] for row in rows}
    headline = {"checkpoint_blocking_fraction": blocked["async (ours)"] / blocked["blocking torch.save"],
                "dcp_async_blocking_fraction": blocked["DCP async_save"] / blocked["blocking torch.save"],
                "blocking_save_s": blocked["blocking torch.save"], "async_blocked_s": blocked["async (ours)"],
                "checkpoint_seconds": writer_s,
                "fwd_bwd_s": statistics.median(m["fwd_bwd_s"] for m in results["no checkpoint"])}
    return rows, headline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of 3 rounds (under a minute)")
    parser.add_argument("--runs", type=common.positive(int), default=1,
                        help="independent runs; each headline figure is its median over the runs")
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim",
                        help="the simulated GPU, or this machine's CUDA GPU (results in checkpoint_cuda.json)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU and a CUDA build of torch (this torch sees none): use --device "
                     "sim")
    rounds, count = (3, 1) if args.quick else (7, args.runs)
    preset, batch_size, block_size = "medium", 8, 128
    if args.device == "cuda" and args.quick:  # on a GPU server the checkpoints' writes dominate: a smaller state
        preset = "small"
    runs = [one_run(rounds, preset, batch_size, block_size, args.device) for _ in range(count)]
    key = "checkpoint_blocking_fraction"
    rows, _ = sorted(runs, key=lambda run: run[1][key])[len(runs) // 2]
    print(f"checkpoints of a {preset} GPT's whole state after every step ({args.device} device, host tier), {rounds} "
          f"interleaved rounds per run, {count} run(s); the median run's rows:")
    print(f"{'checkpoint':<22}{'step ms':>9}{'blocked ms':>12}{'fwd+bwd ms':>12}{'update ms':>11}")
    for row in rows:
        med = {k: row[k]["median"] * 1e3 for k in ("wall_s", "blocked_s", "fwd_bwd_s", "step_s")}
        print(f"{row['checkpoint']:<22}{med['wall_s']:>9.1f}{med['blocked_s']:>12.2f}{med['fwd_bwd_s']:>12.1f}"
              f"{med['step_s']:>11.1f}")
    spread = {name: stats([h[name] for _, h in runs]) for name in runs[0][1]
              if all(isinstance(h[name], float) for _, h in runs)}
    headline = {**{name: values["median"] for name, values in spread.items()}, "runs": count, "spread": spread,
                "targets": {"checkpoint_blocking_fraction": 0.1}}
    print("headline:", ", ".join(f"{k}={v:.4f}" for k, v in headline.items() if isinstance(v, float)))
    config = {"preset": preset, "batch_size": batch_size, "block_size": block_size, "rounds": rounds,
              "quick": args.quick}
    if args.device == "cuda":  # the sim's file keeps its keys as they were
        config["device"] = "cuda"
    name = "checkpoint" if args.device == "sim" else "checkpoint_cuda"
    print(f"wrote {write(name, rows, headline, config)}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
