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


def parse_bytes(text: str) -> int:
    """'64MB' -> 64_000_000, '1.5GiB' -> 1_610_612_736, '4096' -> 4096 (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    units = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": GB, "tb": 1000**4,
             "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024**4}
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text.strip().lower()[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 64MB, 1.5GiB or 4096") from None
    if not 1 <= value < 1e18:
        raise ValueError(f"{text!r} is not a size in bytes between 1 B and 1 EB")
    return int(value)


def require_positive(value: float, what: str) -> None:
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{what} must be a positive number, got {value!r}")
