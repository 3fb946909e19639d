"""What every benchmark shares: the machine description, interleaved rounds, medians, the JSON file."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SCRATCH = Path(__file__).resolve().parents[1] / ".cache"  # git-ignored; on the drive the checkout is on


def scratch() -> tempfile.TemporaryDirectory:
    """A temporary directory under the checkout's .cache/, created first: a fresh clone has none until `make` runs."""
    SCRATCH.mkdir(exist_ok=True)
    return tempfile.TemporaryDirectory(dir=SCRATCH)


def machine() -> dict:
    import torch

    info = {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    return info


def interleaved(contenders: dict[str, Callable[[], dict]], rounds: int, warmup: int = 1) -> dict[str, list[dict]]:
    """Run every contender once per round, in turn (A B C A B C ...), after `warmup` untimed rounds.

    Each contender returns a dict of measurements; the result maps name -> one dict per round.
    """
    for _ in range(warmup):
        for run in contenders.values():
            run()
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            results[name].append(run())
    return results


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write(name: str, rows: list[dict], headline: dict, config: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "config": config, "rows": rows, "headline": headline},
                               indent=2) + "\n")
    return path


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` above zero, or a message naming what was given."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r} must be a positive finite {kind.__name__}")
        return value
    return parse


def run(main: Callable[[], int | None]) -> int:
    """Run a benchmark's main: a failure is one message and exit status 1 (MINIOFFLOAD_DEBUG=1: the traceback)."""
    try:
        return main() or 0
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError, MemoryError) as err:
        if os.environ.get("MINIOFFLOAD_DEBUG") == "1":
            raise
        print(f"{Path(sys.argv[0]).name}: error: {err}\n(MINIOFFLOAD_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
