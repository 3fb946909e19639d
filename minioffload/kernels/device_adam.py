"""The device-side AdamW of the hybrid update (chapter 5): torch's fused kernel on a CUDA tensor, chapter 3's fused
kernel on one thread when the device is simulated.

The hybrid update itself: which subgroups the device updates is `layout.device_subgroups`, the rules of a split
`options.check_split`, its device memory and queued work engine/device_path.py, and the model of the split (the
update phase against the share, the best share, the scratch sets a streamed path needs) predict/hybrid_split.py.

What this is not: a GPU Adam of our own (the chapter writes one with CuPy: gpu_adam.py).
"""

from __future__ import annotations

import numba
import torch

from .adam import adam_fused


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
