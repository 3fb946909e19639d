"""A predicted step (`Prediction`) and how it is read from the schedule: lanes, the resources they occupy, busy and
exposed time, the bound; and a prediction beside a measured run (`compare`). predict/stepmodel.py re-exports all of it.

Lanes: "compute", "d2h", "h2d", "cpu", "nvme_read", "nvme_write", and with ranks "net" (the interconnect); rank r > 0's
own lanes end in ":r" ("cpu:1").

What this is not: the model of the step (predict/stepmodel.py builds and schedules its operations).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..machine.profiles import Hardware
from ..trace import Trace, union_length

_RANKS: dict[str, int | None] = {}  # lane -> rank_of(lane): a step asks it of every op, and there are few lanes


def rank_of(lane: str) -> int | None:
    """The rank whose lane this is: rank r > 0's lanes end in ":r"; rank 0's have no suffix; None for the lanes all
    ranks share ("compute": the ranks compute alike; "net": the collectives occupy every rank at once)."""
    try:
        return _RANKS[lane]
    except KeyError:
        pass
    base, _, rank = lane.partition(":")
    result = int(rank) if rank else (None if base in ("compute", "net", "") else 0)
    if len(_RANKS) < 4096:  # lanes are a few per rank; a bound all the same
        _RANKS[lane] = result
    return result


def resource_of(lane: str, hw: Hardware) -> str:
    """The resource a lane's work occupies on `hw` (lanes that share one are added up, not overlapped). Each rank has
    its own link, cores and drive; on a shared host (the sim) every rank's CPU work and the compute share its cores."""
    base, _, rank = lane.partition(":")
    if hw.shared_host and base in ("compute", "cpu"):
        return "host"
    resource = "nvme" if base in ("nvme_read", "nvme_write") else base  # one drive: reads and writes share it
    return f"{resource}:{rank}" if rank else resource


def _on(name: str, rank: int) -> str:
    """Rank `rank`'s lane or stream called `name`."""
    return f"{name}:{rank}" if rank else name


@dataclass
class Prediction:
    """A predicted step: its length, its trace (the last of the simulated steps, starting at 0), busy time per
    lane, the resource with the most busy time (`bound`: a lane, "nvme" for the drive, "host" for the shared
    cores of the sim, "host memory" when the step's DRAM traffic sets its length), and per lane the busy time
    not hidden behind compute (`exposed`).

    `lower_bound_s`: the step can be no shorter than the busy time of any one resource, each doing only its own
    work with perfect overlap: the compute, each link direction ("d2h", "h2d"), the CPU ("cpu"; on a shared host
    the one "host" that computes and updates), the drive ("nvme": reads and writes), the interconnect ("net"), and
    host DRAM (`host_memory_s`). It is the largest of these; step_s / lower_bound_s says how far the schedule (the
    dependencies between the work) keeps the step from that perfect overlap."""

    step_s: float
    trace: Trace
    busy: dict[str, float]
    exposed: dict[str, float]
    bound: str
    host_memory_s: float = 0.0  # the step's host DRAM traffic over host_bandwidth: a floor on step_s
    # (when a floor sets step_s, bound is "host memory" and the trace shows the schedule it stretched)
    fetch_s: float = 0.0  # streamed parameters: time some block's weights were on their way (NVMe read or H2D)
    exposed_fetch_s: float = 0.0  # ... of which no compute ran at the same time
    ranks: int = 1  # the trace, busy and exposed are rank 0's lanes and the ones all ranks share (compute, net)
    link_bytes: float = 0.0  # bytes over rank 0's host link per step (D2H + H2D)
    rank_link_bytes: tuple[float, ...] = ()  # ... per rank
    interconnect_bytes: float = 0.0  # bytes each rank sends (and receives) over the interconnect per step
    resource_busy: dict[str, float] = field(default_factory=dict)  # resource (resource_of) -> its busy seconds
    lower_bound_s: float = 0.0  # the busiest resource's busy seconds or host_memory_s, whichever is larger

    @property
    def lower_bound(self) -> str:
        """The resource whose busy time is `lower_bound_s` ("host memory" when the DRAM traffic is)."""
        busiest = max(self.resource_busy, key=self.resource_busy.get, default="nothing")
        return "host memory" if self.host_memory_s >= self.resource_busy.get(busiest, 0.0) else busiest

    @property
    def exposed_fetch_fraction(self) -> float:
        """Exposed fetch time over fetch time (0 when nothing is fetched)."""
        return self.exposed_fetch_s / self.fetch_s if self.fetch_s else 0.0

    def summary(self) -> str:
        busy = ", ".join(f"{lane} {seconds * 1e3:.1f}" for lane, seconds in self.busy.items())
        return f"step {self.step_s * 1e3:.1f} ms, bound by {self.bound} (busy ms: {busy})"


def _prediction(trace: Trace, step_s: float, hw: Hardware) -> Prediction:
    # one pass over the spans: (start, end) per lane, in the trace's order (what trace.busy(lane) reads), and the
    # fetches; a resource's intervals are its lanes' (union_length sorts them: their order does not matter)
    on: dict[str, list[tuple[float, float]]] = {}
    fetches = []
    for s in trace.spans:
        interval = (s.start, s.end)
        on.setdefault(s.lane, []).append(interval)
        if s.name.startswith(("fetch block", "read block")):
            fetches.append(interval)
    lanes = sorted(on, key=lambda lane: (lane != "compute", lane))
    busy = {lane: union_length(on[lane]) for lane in lanes}
    compute = on.get("compute", [])
    exposed = {lane: busy[lane] - _overlap(on[lane], compute) for lane in lanes if lane != "compute"}
    resources: dict[str, list] = {}  # in the order each resource first appears in the trace, as its lanes do
    for lane, spans in on.items():
        resources.setdefault(resource_of(lane, hw), []).extend(spans)
    resource_busy = {resource: union_length(spans) for resource, spans in resources.items()}
    bound = max(resource_busy, key=resource_busy.get) if resources else "nothing"
    fetch_s = union_length(fetches)
    return Prediction(step_s, trace, busy, exposed, bound, fetch_s=fetch_s,
                      exposed_fetch_s=fetch_s - _overlap(fetches, compute), resource_busy=resource_busy)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of time covered by both interval sets."""
    return union_length(a) + union_length(b) - union_length(a + b)


def compare(predicted: Prediction, measured_step_s: float, measured: Trace | None = None) -> dict:
    """Predicted beside measured: the step (and each lane's busy time when a measured trace is given), with
    ratios predicted / measured."""
    if not measured_step_s > 0:
        raise ValueError(f"measured_step_s must be positive, got {measured_step_s!r}")
    row = {"predicted_s": predicted.step_s, "measured_s": measured_step_s,
           "ratio": predicted.step_s / measured_step_s,
           "relative_error": abs(predicted.step_s - measured_step_s) / measured_step_s}
    if measured is not None:
        row["lanes"] = {lane: {"predicted_s": seconds, "measured_s": measured.busy(lane)}
                        for lane, seconds in predicted.busy.items()}
    return row
