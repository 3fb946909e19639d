"""The hybrid CPU-GPU update: which subgroups the device updates, the device-side Adam, and the model of the split.

OffloadAdam updates every subgroup on the CPU by default, and the device idles through the update
phase with its memory mostly empty (Maurya et al., 2024). Two ways to give it part of the work:

    gpu_fraction=f   static, like DeepSpeed's Twin-Flow: the last round(f * n) subgroups keep their fp32
                     state on the device for good and are updated there; costs 16 B/param of device memory
                     (state and its gradient buffer)
    stride=k         dynamic, like Deep Optimizer States: every k-th subgroup's state is copied to the device,
                     updated there and copied back (12 B/param each way), while the CPU updates the others;
                     costs `scratch_sets` (2 or 3) subgroups' worth of device scratch

Either way the gradients of device-updated subgroups stay on the device (they are not offloaded), and
the device writes the new weights in place.

The model of the split (the update phase against the share, the best share, the scratch sets a streamed path
needs) is arithmetic only: hybrid_model.py, whose names this module re-exports.

What this is not: an optimizer (see offload.OffloadAdam, which calls these), nor a GPU Adam of our own
(the chapter writes one with CuPy: gpu_adam.py).
"""

from __future__ import annotations

import numba
import torch

from .adam import adam_fused
from .hybrid_model import (  # noqa: F401  (the model of the split: chapter 5 reads it from here)
    best_split,
    best_split_shared,
    link_rate,
    nearest_stride,
    phase_times,
    scratch_sets,
    update_time,
    update_time_shared,
)
from .layout import STATE_BYTES_PER_PARAM, device_subgroups  # noqa: F401  (chapter 5's names: which subgroups,
from .options import check_split  # noqa: F401                 and the split's rules, live there)


def device_adam(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """AdamW in place on flat fp32 tensors: the device-side update. On CUDA, torch's fused kernel (the same
    operation order as torch.optim.AdamW(fused=True)); on the sim's host memory, chapter 3's fused kernel on
    one thread of the calling stream's own (numba's thread count is per thread), so the simulated device
    uses one core and leaves the others to the CPU Adam instead of competing for them."""
    if master.is_cuda:
        # torch.full fills on the device (a kernel); torch.tensor(step, device=...) would copy from pageable
        # memory, which blocks the host and so the CPU update that should run beside this one
        steps = [torch.full((), float(step), dtype=torch.float32, device=master.device)]
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=betas[0],
                            beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    numba.set_num_threads(1)
    adam_fused(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
               weight_decay=weight_decay)
