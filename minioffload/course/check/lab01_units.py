"""Answers with units for Lab 1's estimation problems: read `(value, unit)` or `"112 GB"`, compare, name the mistake.

An estimate is a number and its unit. A learner returns `(112.0, "GB")` or the string `"112 GB"`; `quantity()` turns it
into base units (bytes, seconds or parameters) and `check()` compares it with the expected value to a relative
tolerance. A miss is diagnosed before it is reported: a named mistake of the task (a value the grader computed the
wrong way, "forgot the fp32 master copy"), a number in GiB labelled GB or the other way round, bits for bytes, or a
prefix off by a power of 1000. Every FAIL says what was expected.

This is not a units library (no arithmetic on quantities): the learner computes with plain numbers and the
constants of `minioffload.units`, and labels the result once.
"""

from __future__ import annotations

import math
import re

RTOL = 0.01  # an estimate to 1%: rounding to three digits passes; GB for GiB (7%) and MB for MiB (5%) do not

_DECIMAL = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5}
UNITS: dict[str, tuple[str, float]] = {}  # unit -> (dimension, its size in the dimension's base unit)
for _prefix, _power in _DECIMAL.items():
    UNITS[f"{_prefix}B"] = ("bytes", 1000.0**_power)
    UNITS[f"{_prefix}bit"] = ("bits", 1000.0**_power)
    if _prefix:
        UNITS[f"{_prefix}b"] = ("bits", 1000.0**_power)
for _prefix, _power in _BINARY.items():
    UNITS[f"{_prefix}B"] = ("bytes", 1024.0**_power)
UNITS.update({"s": ("seconds", 1.0), "ms": ("seconds", 1e-3), "us": ("seconds", 1e-6), "µs": ("seconds", 1e-6),
              "min": ("seconds", 60.0), "h": ("seconds", 3600.0)})
for _name, _size in (("", 1.0), ("k ", 1e3), ("M ", 1e6), ("B ", 1e9), ("T ", 1e12),
                     ("thousand ", 1e3), ("million ", 1e6), ("billion ", 1e9), ("trillion ", 1e12)):
    UNITS[f"{_name}params"] = ("params", _size)
BASE = {"bytes": "B", "seconds": "s", "params": "params"}
EXAMPLE = {"bytes": '(112.0, "GB") or "112 GB"', "seconds": '(3.6, "s") or "3.6 s"',
           "params": '(5.0, "B params") or "5e9 params"'}


def quantity(answer: object, dimension: str) -> tuple[float, str]:
    """(value in the base unit of `dimension`, the unit the learner wrote); AssertionError naming what is wrong."""
    how = f"return (value, unit), e.g. {EXAMPLE[dimension]}"
    if isinstance(answer, str):
        match = re.fullmatch(r"\s*([-+0-9.eE_,]+)\s*(.*?)\s*", answer)
        assert match, f"could not read {answer!r} as a number and a unit: {how}"
        number, unit = match[1].replace(",", "").replace("_", ""), match[2]
    elif isinstance(answer, tuple) and len(answer) == 2:
        number, unit = answer
    else:
        raise AssertionError(f"returned {answer!r}, a bare {type(answer).__name__}: an estimate carries its unit, "
                             f"so {how}")
    try:
        value = float(number)
    except (TypeError, ValueError):
        raise AssertionError(f"could not read {number!r} as a number: {how}") from None
    assert isinstance(unit, str) and unit.strip() in UNITS, (
        f"unknown unit {unit!r}; use one of {', '.join(u for u, (d, _) in UNITS.items() if d == dimension)}")
    unit = unit.strip()
    unit_dimension, size = UNITS[unit]
    if unit_dimension == "bits" and dimension == "bytes":
        raise AssertionError(f"{unit!r} is a unit of bits; memory is counted in bytes (B, GB, GiB ...): 1 byte is "
                             f"8 bits")
    assert unit_dimension == dimension, (
        f"{unit!r} measures {unit_dimension}; this answer is {dimension}: {how}")
    assert math.isfinite(value), f"returned {value!r}; expected a finite number"
    return value * size, unit


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL)


def _show(value_base: float, unit: str) -> str:
    return f"{value_base / UNITS[unit][1]:.4g} {unit}"


def check(answer: object, expected: float, dimension: str, what: str,
          mistakes: dict[str, float] | None = None) -> tuple[float, str]:
    """Compare `answer` with `expected` (base units) to RTOL; return (value in base units, unit) or fail, naming the
    mistake. `mistakes`: {what the learner did wrong: the value (base units) that mistake gives}."""
    got, unit = quantity(answer, dimension)
    if _close(got, expected):
        return got, unit
    said = f"{what}: you returned {answer!r}, expected {_show(expected, unit)}"
    for mistake, value in (mistakes or {}).items():
        if _close(got, value) and not _close(value, expected):
            raise AssertionError(f"{said}; that is what you get if you {mistake}")
    if dimension == "bytes":
        number = got / UNITS[unit][1]
        for prefix, power in _DECIMAL.items():
            if power and unit == f"{prefix}B" and _close(number * 1024.0**power, expected):
                raise AssertionError(f"{said}: your number is in {prefix.upper()}iB (2**{10 * power} bytes) but "
                                     f"labelled {unit} (10**{3 * power} bytes); GiB and GB differ by 7%")
        for prefix, power in _BINARY.items():
            if unit == f"{prefix}B" and _close(number * 1000.0**power, expected):
                raise AssertionError(f"{said}: your number is in {prefix[0]}B (10**{3 * power} bytes) but labelled "
                                     f"{unit} (2**{10 * power} bytes); GiB and GB differ by 7%")
        if _close(got, 8 * expected) or _close(got * 8, expected):
            raise AssertionError(f"{said}: off by a factor of 8, bits for bytes (a byte is 8 bits)")
    for power in (-4, -3, -2, -1, 1, 2, 3, 4):
        if _close(got, expected * 1000.0**power):
            raise AssertionError(f"{said}: off by a factor of 10**{3 * power}; check the unit's prefix (k, M, G, "
                                 f"T are steps of 1000{', ms is 1/1000 s' if dimension == 'seconds' else ''})")
    raise AssertionError(said)
