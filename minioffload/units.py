"""Byte units, their printing, and the check that a size is positive: the one place each is defined."""

MiB = 1024**2
GiB = 1024**3
GB = 1000**3  # decimal: GPUs and drives are sold in GB


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'. Binary units, as allocators and nvidia-smi report them."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def require_positive(value: float, what: str) -> None:
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{what} must be a positive number, got {value!r}")
