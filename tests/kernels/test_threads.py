"""Numba's thread pool leaves torch's thread count alone (kernels/__init__.py): a process that computes on one thread
keeps computing on one after its first Numba kernel, so its results do not change in the last bits mid-run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
before = torch.get_num_threads()
from minioffload.kernels.gradnorm import sum_of_squares
sum_of_squares(torch.ones(100_000))  # a parallel kernel: Numba's pool is running
import numba
print(before, torch.get_num_threads(), numba.get_num_threads())
"""


def test_torch_keeps_its_thread_count_after_the_first_numba_kernel():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    before, after, numba_threads = map(int, done.stdout.split())
    assert (before, after) == (1, 1), done.stdout
    assert numba_threads == 2  # Numba's kernels keep their own count
