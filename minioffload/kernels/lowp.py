"""16-bit floats as raw bits: bf16 and fp16 to and from fp32, rounding to nearest even.

Numba has no float16 on the CPU and NumPy has no bfloat16, so the CPU Adam reads and writes 16-bit
values as uint16 bit patterns and converts with these scalar functions, inlined into its loop.
`as_bits` / `from_bits` move between torch tensors and those uint16 arrays without copying.

Rounding matches torch's: round to nearest, ties to even; overflow to infinity; fp16 subnormals kept.
NaN stays NaN (torch's own conversions do not agree on which NaN bit pattern they produce, so tests
compare NaN-ness, not NaN bits).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

LOWP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@numba.njit(inline="always", cache=True)
def bf16_to_f32(bits: np.uint16) -> np.float32:
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always", cache=True)
def f32_to_bf16(value: np.float32) -> np.uint16:
    bits = np.float32(value).view(np.uint32)
    rounding_bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))  # ties to even
    rounded = (bits + rounding_bias) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)  # NaN: keep sign, set the quiet bit, drop payload
    # a select, not a branch, so the loop around it vectorizes
    return np.uint16(quiet_nan if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@numba.njit(inline="always", cache=True)
def f16_to_f32(bits: np.uint16) -> np.float32:
    h = np.uint32(bits)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = (h >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = h & np.uint32(0x3FF)
    if exponent == 0:  # zero or subnormal: mantissa * 2^-24, exact in fp32
        magnitude = np.float32(mantissa) * np.float32(5.9604644775390625e-08)
        return -magnitude if sign else magnitude
    if exponent == 31:  # inf or NaN
        return np.uint32(sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13))).view(np.float32)
    return np.uint32(sign | ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))).view(
        np.float32)


@numba.njit(inline="always", cache=True)
def _round_shift(value: np.uint32, shift: np.uint32) -> np.uint32:
    """value >> shift, rounded to nearest, ties to even (shift >= 1)."""
    quotient = value >> shift
    remainder = value & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    if remainder > half or (remainder == half and (quotient & np.uint32(1))):
        quotient += np.uint32(1)
    return quotient


@numba.njit(inline="always", cache=True)
def f32_to_f16(value: np.float32) -> np.uint16:
    bits = np.float32(value).view(np.uint32)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    exponent = (bits >> np.uint32(23)) & np.uint32(0xFF)
    mantissa = bits & np.uint32(0x7FFFFF)
    if exponent == 255:  # inf or NaN
        return np.uint16(sign | np.uint32(0x7C00) | (np.uint32(0x200) if mantissa else np.uint32(0)))
    if exponent >= 143:  # |value| >= 65536: beyond fp16's range
        return np.uint16(sign | np.uint32(0x7C00))
    if exponent <= 112:  # fp16 subnormal (or zero): units of 2^-24
        if exponent < 102:  # below half the smallest subnormal: rounds to zero
            return np.uint16(sign)
        return np.uint16(sign | _round_shift(mantissa | np.uint32(0x800000), np.uint32(126) - exponent))
    # normal: rebias the exponent, round the mantissa from 23 to 10 bits; a carry may reach infinity
    return np.uint16(sign | _round_shift(((exponent - np.uint32(112)) << np.uint32(23)) | mantissa, np.uint32(13)))


def as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A bf16/fp16 CPU tensor's memory as a uint16 NumPy array (no copy)."""
    if tensor.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"as_bits takes a bf16 or fp16 tensor, got {tensor.dtype}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("as_bits needs a contiguous CPU tensor; call .contiguous().cpu() first")
    return tensor.view(torch.int16).numpy().view(np.uint16)


def from_bits(bits: np.ndarray, dtype: str) -> torch.Tensor:
    """A uint16 array of bf16/fp16 bit patterns as a torch tensor of that dtype (no copy)."""
    if dtype not in LOWP_DTYPES:
        raise ValueError(f"unknown 16-bit dtype {dtype!r}; choose one of {sorted(LOWP_DTYPES)}")
    return torch.from_numpy(bits.view(np.int16)).view(LOWP_DTYPES[dtype])
