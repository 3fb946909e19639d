"""The planner's exact part: how many blocks take each activation policy and how many of the optimizer's subgroups
are updated on the device, for the least added time within the memory left. Two solvers, one signature:

    best = solve(problem)              # a mixed-integer program, scipy.optimize.milp (HiGHS)
    same = brute_force(problem)        # every policy for every block, every split: small problems only

The blocks of a GPT are equal, so the program counts blocks per policy (n_p, integers summing to the number of
blocks) rather than choosing per block; `brute_force` does choose per block, P^L assignments, which is what makes
it a check. With r subgroups of the optimizer updated on the device (chapter 5's gpu_fraction = r / G) and t the
update's length:

    minimise   sum_p n_p extra_p + t
    subject to sum_p n_p = L,  n_p <= L z_p                               (z_p = 1: some block takes policy p)
               sum_p (n_p device_p + z_p in_flight_p) + r resident_bytes <= device_budget
                                                   (activations held, a set on its way out once, resident state)
               sum_p n_p host_p <= host_budget                            (offloaded activations, pinned)
               t >= (G - r) cpu_s,  t >= r device_s                       (the two updates overlap) or, when the
               t >= (G - r) cpu_s + r device_s                            device computes on the CPU's cores (sim)
               0 <= r <= max_resident, n_p >= 0 integers, z_p binary

What this is not: the step model. The program's times are a linear stand-in for what stepmodel.predict schedules;
planner/search.py ranks the candidates the program returns by stepmodel's predictions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

BRUTE_FORCE_LIMIT = 200_000  # assignments x splits brute_force will try


@dataclass(frozen=True)
class Option:
    """One activation policy for one block: bytes it holds on the device and in pinned host memory between the
    block's forward and backward, and the step time it adds."""

    name: str
    device_bytes: float
    host_bytes: float
    extra_s: float
    in_flight_bytes: float = 0.0  # device bytes held once when any block takes it (a copy on its way to the host)


@dataclass(frozen=True)
class Problem:
    num_blocks: int
    options: tuple[Option, ...]
    device_budget: float  # bytes on the device for the activations held and the resident subgroups
    host_budget: float = math.inf  # pinned host bytes for offloaded activations
    subgroups: int = 1  # G: the optimizer's subgroups
    max_resident: int = 0  # subgroups that may be updated on the device (0: no hybrid update)
    resident_bytes: float = 0.0  # device bytes per subgroup updated there (its state and gradient)
    cpu_s: float = 0.0  # seconds to update one subgroup on the CPU
    device_s: float = 0.0  # ... on the device
    shared: bool = False  # device and CPU share the cores: the two updates add up instead of overlapping

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or not self.options:
            raise ValueError(f"a problem needs at least one block and one option, got {self.num_blocks} blocks and "
                             f"{len(self.options)} options")
        if not 0 <= self.max_resident <= self.subgroups:
            raise ValueError(f"max_resident must be in [0, subgroups={self.subgroups}], got {self.max_resident}")

    def update_s(self, resident: int) -> float:
        cpu, device = (self.subgroups - resident) * self.cpu_s, resident * self.device_s
        return cpu + device if self.shared else max(cpu, device)

    def objective(self, counts: dict[str, int], resident: int) -> float:
        extra = sum(o.extra_s * counts.get(o.name, 0) for o in self.options)
        return extra + self.update_s(resident)

    def device_bytes(self, counts: dict[str, int], resident: int) -> float:
        held = sum(o.device_bytes * counts.get(o.name, 0) + o.in_flight_bytes * bool(counts.get(o.name))
                   for o in self.options)
        return held + resident * self.resident_bytes

    def fits(self, counts: dict[str, int], resident: int) -> bool:
        device = self.device_bytes(counts, resident)
        host = sum(o.host_bytes * counts.get(o.name, 0) for o in self.options)
        return device <= self.device_budget * (1 + 1e-9) and host <= self.host_budget * (1 + 1e-9)


@dataclass(frozen=True)
class Solution:
    counts: dict  # policy -> blocks
    resident: int  # subgroups updated on the device
    objective: float  # seconds the program adds: the policies' extra time and the update's length

    def policies(self, order: tuple[str, ...]) -> tuple[str, ...]:
        """One policy per block: the costlier-to-recompute policies first (in `order`), as search.py lays them out."""
        return tuple(name for name in order for _ in range(self.counts.get(name, 0)))


def solve(problem: Problem) -> Solution | None:
    """The optimum by scipy.optimize.milp (HiGHS); None when nothing fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    opts, n = problem.options, len(problem.options)
    # variables: n_p (one per option), z_p (one per option), r, t
    c = np.array([o.extra_s for o in opts] + [0.0] * n + [0.0, 1.0])
    rows, lo, hi = [], [], []

    def row(counts, flags=None, resident=0.0, t=0.0):
        return list(counts) + list(flags or [0.0] * n) + [resident, t]

    rows.append(row([1.0] * n))
    lo.append(problem.num_blocks)
    hi.append(problem.num_blocks)
    for p in range(n):  # n_p - L z_p <= 0
        rows.append(row([1.0 * (q == p) for q in range(n)], [-problem.num_blocks * (q == p) for q in range(n)]))
        lo.append(-np.inf)
        hi.append(0.0)
    # memory rows are divided by their largest number, so HiGHS's absolute tolerances (1e-7) are relative here
    device = row([o.device_bytes for o in opts], [o.in_flight_bytes for o in opts], problem.resident_bytes)
    scale = max(*device, problem.device_budget, 1.0)
    rows.append([v / scale for v in device])
    lo.append(-np.inf)
    hi.append(problem.device_budget / scale)
    if math.isfinite(problem.host_budget):
        host = row([o.host_bytes for o in opts])
        scale = max(*host, problem.host_budget, 1.0)
        rows.append([v / scale for v in host])
        lo.append(-np.inf)
        hi.append(problem.host_budget / scale)
    g = problem.subgroups
    if problem.shared:  # t - (G - r) cpu_s - r device_s >= 0
        rows.append(row([0.0] * n, None, problem.cpu_s - problem.device_s, 1.0))
        lo.append(g * problem.cpu_s)
        hi.append(np.inf)
    else:
        rows.append(row([0.0] * n, None, problem.cpu_s, 1.0))  # t + r cpu_s >= G cpu_s
        lo.append(g * problem.cpu_s)
        hi.append(np.inf)
        rows.append(row([0.0] * n, None, -problem.device_s, 1.0))  # t - r device_s >= 0
        lo.append(0.0)
        hi.append(np.inf)
    bounds = Bounds([0.0] * (2 * n) + [0.0, 0.0],
                    [problem.num_blocks] * n + [1.0] * n + [problem.max_resident, np.inf])
    integrality = np.array([1] * (2 * n + 1) + [0])
    result = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), bounds=bounds, integrality=integrality)
    if result.status != 0 or result.x is None:  # 2: infeasible
        return None
    x = np.round(result.x).astype(int)
    counts = {o.name: int(k) for o, k in zip(opts, x[:n], strict=True) if k}
    resident = int(x[2 * n])
    if not problem.fits(counts, resident):  # rounding pushed it over: refuse rather than return a misfit
        return None
    return Solution(counts, resident, problem.objective(counts, resident))


def brute_force(problem: Problem) -> Solution | None:
    """The optimum by trying every policy for every block and every split; refuses problems over
    BRUTE_FORCE_LIMIT assignments."""
    size = len(problem.options) ** problem.num_blocks * (problem.max_resident + 1)
    if size > BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute_force tries {size:,} assignments, over its limit of {BRUTE_FORCE_LIMIT:,}: use "
                         "solve() (the MILP) for problems this large")
    best = None
    for assignment in itertools.product(problem.options, repeat=problem.num_blocks):
        counts: dict[str, int] = {}
        for option in assignment:
            counts[option.name] = counts.get(option.name, 0) + 1
        for resident in range(problem.max_resident + 1):
            if problem.fits(counts, resident):
                value = problem.objective(counts, resident)
                if best is None or value < best.objective - 1e-15:
                    best = Solution(counts, resident, value)
    return best
