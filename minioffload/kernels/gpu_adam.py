"""Our own GPU AdamW: one CuPy ElementwiseKernel, a few lines of CUDA C, for chapter 5's device-side update.

    adam_cupy(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

Takes CUDA torch tensors (fp32, contiguous, same size) and updates them in place; CuPy sees the same memory
through DLPack, so nothing is copied. One thread per element, one pass: read p, g, m, v; write p, m, v
(28 B/param), like the CPU kernel of chapter 3. The per-step scalars (bias corrections) are computed once
on the host in float64, as torch does. It needs CuPy (`pip install cupy-cuda12x`) and a GPU; the engine
itself uses torch's fused kernel (hybrid.device_adam), which this one is compared with.

What this is not: a multi-tensor kernel (one launch per flat buffer is enough for subgroups).
"""

from __future__ import annotations

import math

import torch

ADAM_KERNEL = r"""
    float m = exp_avg + (grad - exp_avg) * one_minus_beta1;          // lerp, as torch does
    float v = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad;
    float denom = sqrtf(v) / bias_correction2_sqrt + eps;
    param = param * decay - step_size * m / denom;
    exp_avg = m;
    exp_avg_sq = v;
"""

_kernel = None


def _compiled():
    global _kernel
    if _kernel is None:
        import cupy  # optional: only this function needs it

        _kernel = cupy.ElementwiseKernel(
            "float32 grad, float32 one_minus_beta1, float32 beta2, float32 one_minus_beta2, float32 eps, "
            "float32 step_size, float32 bias_correction2_sqrt, float32 decay",
            "float32 param, float32 exp_avg, float32 exp_avg_sq", ADAM_KERNEL, "minioffload_adamw")
    return _kernel


def adam_cupy(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int = 1, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.01) -> None:
    """AdamW in place on CUDA fp32 tensors with the CuPy kernel above."""
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in tensors.items():
        if not (t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == param.numel()):
            raise ValueError(f"{name} must be a contiguous CUDA float32 tensor of {param.numel()} elements, got "
                             f"{t.dtype} on {t.device} with {t.numel()}")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    import cupy

    beta1, beta2 = betas
    p, g, m, v = (cupy.from_dlpack(t.detach()) for t in (param, grad, exp_avg, exp_avg_sq))
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(param.device).cuda_stream):
        _compiled()(g, 1 - beta1, beta2, 1 - beta2, eps, lr / (1 - beta1**step),
                    math.sqrt(1 - beta2**step), 1 - lr * weight_decay, p, m, v)
