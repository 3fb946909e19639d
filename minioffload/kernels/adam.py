"""CPU Adam/AdamW, from readable NumPy to one fused Numba pass, fp32 and mixed precision.

Versions with one signature, slowest first, each validated against `adam_ref` and torch:

    adam_ref(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, decoupled)
        textbook NumPy; every line makes a temporary array
    adam_inplace(...)   NumPy with `out=` everywhere and one scratch buffer (two with L2 decay)
    adam_fused(...)     one Numba pass over the arrays, all threads, nothing temporary
    adam_fused_into(..., param_out, exp_avg_out, exp_avg_sq_out, *, grad_scale, ...)
                        the same pass writing its results elsewhere, the inputs left as they were (the engine's
                        speculative update redoes from them); about 2x the in-place pass on our machines, since
                        writing lines it has not read costs the CPU a read of each first
    adam_mixed(param, grad_lowp, exp_avg, exp_avg_sq, param_lowp_out, *, dtype="bf16", ...)
        the fused pass reading a bf16/fp16 gradient and also writing the updated weights as bf16/fp16
        into `param_lowp_out` (the buffer that goes back to the GPU): 28 bytes per parameter

All update in place and accept NumPy arrays or CPU torch tensors (fp32 param and state; any
contiguous shape). Slices work, so a caller updates one subgroup at a time. `decoupled=True` is AdamW
(weight decay applied to the weights), False is Adam with L2 decay added to the gradient.

The fused kernels follow torch's single-tensor Adam operation by operation (lerp for exp_avg,
`sqrt(v) / sqrt(bias_correction2) + eps`, bias corrections computed in float64), so they agree with
torch to a few ulp. Why fused: the update is memory-bound (about 28 B moved and a dozen flops per
parameter), so the only way to go faster is to move fewer bytes: one pass, no temporaries.

What this is not: an optimizer class (that is chapter 4's `OffloadAdam`); no AMSGrad, no maximize.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from numba import prange

from .lowp import as_bits, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16

# ---------------------------------------------------------------------------------------------
# arguments


def _array(x, name: str, dtype=np.float32) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.bfloat16, torch.float16):
            x = torch.from_numpy(as_bits(x)) if x.is_contiguous() else x
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device}; the CPU Adam needs CPU memory (copy it to the host first)")
        if not x.is_contiguous():
            raise ValueError(f"{name} is not contiguous; call .contiguous() first")
        x = x.numpy()
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a NumPy array or a CPU torch tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}; expected {np.dtype(dtype)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} is not contiguous; pass np.ascontiguousarray({name}) or a contiguous slice")
    return x.reshape(-1)


def _hyper(step, lr, beta1, beta2, eps, weight_decay) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count of updates including this one), got {step!r}")
    checks = [("lr", lr, 0 <= lr < math.inf, ">= 0"), ("beta1", beta1, 0 <= beta1 < 1, "in [0, 1)"),
              ("beta2", beta2, 0 <= beta2 < 1, "in [0, 1)"), ("eps", eps, 0 < eps < math.inf, "> 0"),
              ("weight_decay", weight_decay, 0 <= weight_decay < math.inf, ">= 0")]
    for name, value, ok, allowed in checks:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise ValueError(f"{name} must be {allowed} and finite, got {value!r}")


def _arrays(param, grad, exp_avg, exp_avg_sq, grad_dtype=np.float32):
    arrays = (_array(param, "param"), _array(grad, "grad", grad_dtype), _array(exp_avg, "exp_avg"),
              _array(exp_avg_sq, "exp_avg_sq"))
    sizes = {name: a.size for name, a in zip(("param", "grad", "exp_avg", "exp_avg_sq"), arrays, strict=True)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"param, grad and state must have the same number of elements, got {sizes}")
    return arrays


def _constants(step, lr, beta1, beta2, eps, weight_decay, decoupled) -> tuple:
    """The per-step scalars, computed in float64 as torch does, then rounded once to float32."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    f = np.float32
    return (f(1 - beta1), beta1 >= 0.5, f(beta2), f(1 - beta2), f(eps), f(-lr / bias_correction1),
            f(bias_correction2_sqrt), f(1 - lr * weight_decay) if decoupled else f(1.0),
            f(0.0) if decoupled else f(weight_decay))


def _numpy_version(body):
    """Give a NumPy body the shared signature: argument checks first, then inf/NaN propagating silently."""

    @functools.wraps(body)
    def version(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True) -> None:
        _hyper(step, lr, beta1, beta2, eps, weight_decay)
        arrays = _arrays(param, grad, exp_avg, exp_avg_sq)
        with np.errstate(all="ignore"):  # inf and NaN propagate as in torch, without warnings
            body(*arrays, step, lr, beta1, beta2, eps, weight_decay, decoupled)

    return version


# ---------------------------------------------------------------------------------------------
# 1. reference: readable, with temporaries


def _adam_ref(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled) -> None:
    if weight_decay and not decoupled:
        grad = grad + weight_decay * param  # Adam: L2 decay joins the gradient
    if weight_decay and decoupled:
        param *= 1 - lr * weight_decay  # AdamW: decay the weights themselves
    exp_avg[:] = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq[:] = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = exp_avg / (1 - beta1**step)
    v_hat = exp_avg_sq / (1 - beta2**step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)


adam_ref = _numpy_version(_adam_ref)


# ---------------------------------------------------------------------------------------------
# 2. in place: the same arithmetic with out=, one scratch buffer


def _adam_inplace(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled) -> None:
    scratch = np.empty_like(param)  # (n,) fp32: the one temporary
    if weight_decay and not decoupled:  # a second buffer: the gradient itself is read-only
        with_decay = np.multiply(param, np.float32(weight_decay), out=np.empty_like(param))
        with_decay += grad
        grad = with_decay
    if weight_decay and decoupled:
        param *= np.float32(1 - lr * weight_decay)
    exp_avg *= np.float32(beta1)
    np.multiply(grad, np.float32(1 - beta1), out=scratch)
    exp_avg += scratch
    exp_avg_sq *= np.float32(beta2)
    np.multiply(grad, grad, out=scratch)
    scratch *= np.float32(1 - beta2)
    exp_avg_sq += scratch
    np.sqrt(exp_avg_sq, out=scratch)
    scratch /= np.float32(math.sqrt(1 - beta2**step))
    scratch += np.float32(eps)
    np.divide(exp_avg, scratch, out=scratch)
    scratch *= np.float32(lr / (1 - beta1**step))
    param -= scratch


adam_inplace = _numpy_version(_adam_inplace)


# ---------------------------------------------------------------------------------------------
# 3. fused: one pass, Numba, all threads


@numba.njit(inline="always", cache=True)
def _update(p, g, m, v, one_minus_beta1, lerp_low, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
            decay, l2):
    """One parameter's AdamW/Adam update, in torch's operation order. Returns (p, m, v)."""
    if l2 != 0:
        g = g + l2 * p  # Adam's L2 decay (skipped at 0 so an inf weight does not turn the gradient NaN)
    p = p * decay  # AdamW's decoupled decay (1.0 when off)
    if lerp_low:  # torch's lerp(m, g, w): m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
        m = m + one_minus_beta1 * (g - m)
    else:
        m = g - (g - m) * (np.float32(1) - one_minus_beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = np.sqrt(v) / bc2_sqrt + eps
    p = p + neg_step_size * m / denom
    return p, m, v


@numba.njit(parallel=True, nogil=True, cache=True)
def _fused_fp32(param, grad, exp_avg, exp_avg_sq, c0, c1, c2, c3, c4, c5, c6, c7, c8):
    for i in prange(param.size):
        param[i], exp_avg[i], exp_avg_sq[i] = _update(param[i], grad[i], exp_avg[i], exp_avg_sq[i],
                                                      c0, c1, c2, c3, c4, c5, c6, c7, c8)


@numba.njit(parallel=True, nogil=True, cache=True)
def _fused_bf16(param, grad_bits, exp_avg, exp_avg_sq, out_bits, c0, c1, c2, c3, c4, c5, c6, c7, c8):
    for i in prange(param.size):
        p, exp_avg[i], exp_avg_sq[i] = _update(param[i], bf16_to_f32(grad_bits[i]), exp_avg[i], exp_avg_sq[i],
                                               c0, c1, c2, c3, c4, c5, c6, c7, c8)
        param[i] = p
        out_bits[i] = f32_to_bf16(p)


@numba.njit(parallel=True, nogil=True, cache=True)
def _fused_fp16(param, grad_bits, exp_avg, exp_avg_sq, out_bits, c0, c1, c2, c3, c4, c5, c6, c7, c8):
    for i in prange(param.size):
        p, exp_avg[i], exp_avg_sq[i] = _update(param[i], f16_to_f32(grad_bits[i]), exp_avg[i], exp_avg_sq[i],
                                               c0, c1, c2, c3, c4, c5, c6, c7, c8)
        param[i] = p
        out_bits[i] = f32_to_f16(p)


def adam_fused(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True) -> None:
    _hyper(step, lr, beta1, beta2, eps, weight_decay)
    param, grad, exp_avg, exp_avg_sq = _arrays(param, grad, exp_avg, exp_avg_sq)
    _fused_fp32(param, grad, exp_avg, exp_avg_sq, *_constants(step, lr, beta1, beta2, eps, weight_decay, decoupled))


# ---------------------------------------------------------------------------------------------
# 3b. fused, out of place: the speculative update (chapter 4) keeps the pre-step state to redo from


@numba.njit(parallel=True, nogil=True, cache=True)
def _fused_fp32_into(param, grad, exp_avg, exp_avg_sq, grad_scale, param_out, exp_avg_out, exp_avg_sq_out,
                     c0, c1, c2, c3, c4, c5, c6, c7, c8):
    for i in prange(param.size):  # grad * scale rounds as grad.mul_(scale) does; * 1 changes nothing
        param_out[i], exp_avg_out[i], exp_avg_sq_out[i] = _update(param[i], grad[i] * grad_scale, exp_avg[i],
                                                                  exp_avg_sq[i], c0, c1, c2, c3, c4, c5, c6, c7, c8)


def adam_fused_into(param, grad, exp_avg, exp_avg_sq, param_out, exp_avg_out, exp_avg_sq_out, *, grad_scale: float,
                    step: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                    weight_decay: float = 0.0, decoupled: bool = True) -> None:
    """adam_fused on `grad * grad_scale`, reading param and state and writing the results into the `_out` arrays:
    the inputs stay as they were. Bit for bit what `grad.mul_(grad_scale)` then `adam_fused` give in place."""
    _hyper(step, lr, beta1, beta2, eps, weight_decay)
    arrays = _arrays(param, grad, exp_avg, exp_avg_sq)
    outs = [_array(x, name) for x, name in ((param_out, "param_out"), (exp_avg_out, "exp_avg_out"),
                                            (exp_avg_sq_out, "exp_avg_sq_out"))]
    if any(out.size != arrays[0].size for out in outs):
        raise ValueError(f"the _out arrays have {[out.size for out in outs]} elements; param has {arrays[0].size}")
    _fused_fp32_into(*arrays, np.float32(grad_scale), *outs,
                     *_constants(step, lr, beta1, beta2, eps, weight_decay, decoupled))


# ---------------------------------------------------------------------------------------------
# 4. mixed precision: 16-bit gradient in, fp32 master and state updated, 16-bit weights out

_MIXED = {"bf16": _fused_bf16, "fp16": _fused_fp16}


def adam_mixed(param, grad_lowp, exp_avg, exp_avg_sq, param_lowp_out, *, dtype: str = "bf16", step: int,
               lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, decoupled: bool = True) -> None:
    """grad_lowp and param_lowp_out: bf16/fp16 torch tensors, or uint16 arrays of their bits."""
    if dtype not in _MIXED:
        raise ValueError(f"dtype must be one of {sorted(_MIXED)}, got {dtype!r}")
    for name, tensor in (("grad_lowp", grad_lowp), ("param_lowp_out", param_lowp_out)):
        expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        if isinstance(tensor, torch.Tensor) and tensor.dtype != expected:
            raise ValueError(f"{name} is {tensor.dtype} but dtype={dtype!r}; pass dtype to match")
    _hyper(step, lr, beta1, beta2, eps, weight_decay)
    param, grad_bits, exp_avg, exp_avg_sq = _arrays(param, grad_lowp, exp_avg, exp_avg_sq, grad_dtype=np.uint16)
    out_bits = _array(param_lowp_out, "param_lowp_out", np.uint16)
    if out_bits.size != param.size:
        raise ValueError(f"param_lowp_out has {out_bits.size} elements; param has {param.size}")
    _MIXED[dtype](param, grad_bits, exp_avg, exp_avg_sq, out_bits,
                  *_constants(step, lr, beta1, beta2, eps, weight_decay, decoupled))


VERSIONS = {"adam_ref": adam_ref, "adam_inplace": adam_inplace, "adam_fused": adam_fused}


def set_threads(n: int) -> None:
    """Threads the fused kernels use (1 .. numba.config.NUMBA_NUM_THREADS)."""
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in 1..{numba.config.NUMBA_NUM_THREADS}, got {n}")
    numba.set_num_threads(n)
