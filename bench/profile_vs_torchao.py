"""Where our offloaded step spends the time torchao's CPUOffloadOptimizer does not, on a CUDA machine: the same GPT
and batch as offload_step's comparison (gpt2-small-ish, 16 x 256 tokens), each step split into forward, backward
and update (each ended by a device synchronize), then torch.profiler over a few steps of each, its top operators by
self CPU time and by device time.

    python bench/profile_vs_torchao.py [--steps 5]   # writes $OUT/profile_vs_torchao.txt (or bench/results/gpu/)

This is a diagnosis, not a benchmark: it has no headline, and the synchronizes between phases change what overlaps.
torchao comes from the machine's python or bench/wheels, as gpu_check installs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402

from minioffload.devices import device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.model import gpt as models  # noqa: E402

BATCH, BLOCK = 16, 256
SETUPS = {"ours, defaults": {}, "ours, 1M speculative + buckets":
          {"subgroup_numel": 1 << 20, "speculative": True, "bucket_numel": 1 << 20}, "torchao": None}


def build(options):
    text = models.load_text()
    tokenizer = models.CharTokenizer(text)
    data = torch.tensor(tokenizer.encode(text))
    torch.manual_seed(0)
    dev = device("cuda")
    model = dev.place(models.GPT(models.GPTConfig.preset("gpt2-small-ish", tokenizer.vocab_size, block_size=BLOCK)))
    if options is None:
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True, lr=1e-3)
    else:
        opt = OffloadAdam(model.parameters(), dev, lr=1e-3, **options)
    generator = torch.Generator().manual_seed(0)

    def step() -> tuple[float, float, float]:
        x, y = (t.cuda() for t in models.batches(data, BLOCK, BATCH, generator))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step, dev, opt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    _, extra = gpu_check.setup_torchao(gpu_check.WHEEL_DIR, tempfile.mkdtemp(prefix="profile_torchao_"))
    if extra:
        sys.path.insert(0, extra)
    out = Path(os.environ.get("OUT") or gpu_check.ROOT / "bench" / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    report = []
    for name, options in SETUPS.items():
        try:
            step, dev, opt = build(options)
        except ImportError as err:
            report.append(f"===== {name}: not run ({err})\n")
            continue
        for _ in range(3):
            step()
        phases = [step() for _ in range(args.steps)]
        medians = [statistics.median(p[i] for p in phases) * 1e3 for i in range(3)]
        line = (f"===== {name}: forward {medians[0]:.1f} ms, backward {medians[1]:.1f} ms, update {medians[2]:.1f} ms "
                f"(medians of {args.steps} steps, each phase ended by a synchronize)")
        print(line)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                step()
        table = prof.key_averages()
        report += [line + "\n", "-- by self CPU time (3 steps)\n",
                   table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60) + "\n",
                   "-- by device time (3 steps)\n",
                   table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60) + "\n"]
        if hasattr(opt, "close"):
            opt.close()
        dev.close()
    (out / "profile_vs_torchao.txt").write_text("".join(report))
    print(f"wrote {out / 'profile_vs_torchao.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
