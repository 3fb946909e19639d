"""N ranks inside one Python process, for Lab 10: `ThreadGroup(world)` runs `fn(rank, comm)` on N threads, each rank
with its own simulated device, and `comm` offers the torch.distributed calls the lab needs, with their semantics.

    with ThreadGroup(2) as group:                       # two ranks, group.devices[r] is rank r's SimDevice
        results = group.run(lambda rank, comm: work(comm, group.devices[rank]))

Why not torch.distributed itself: its ranks are processes, and a spawned process cannot import a function defined
in a notebook. The engine (sharding.py) makes the same calls on torch.distributed; here they meet at a barrier and
the last rank to arrive does the collective for all of them, summing in rank order (rank 0 + rank 1 + ...), so a
result is the same bits on every run. Every rank must call the same collectives in the same order, as with
torch.distributed; where they do not (another collective, another root, a rank that returned), each waiting rank
raises `CollectiveMismatch` naming what each rank called, instead of hanging. Collectives take device tensors of the
calling rank's device, as NCCL does.

The group counts, per rank, what the collectives delivered: `summed[r]`, the bytes of sums rank r received (a reduce's
root, every rank of an all-reduce), and `received[r]`, the bytes that reached rank r from the others under NCCL's ring
algorithms (an all-gather: the other N-1 shards; an all-reduce: 2 (N-1)/N of the buffer; a broadcast: the buffer, on
every rank but the root; a reduce: the buffer, on every rank but the one after the root in the ring).

What this is not: a process group (no async_op, no groups, SUM only), or a model of the network's time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...devices import device
from ...devices.hazards import HazardError

TIMEOUT_S = 60.0


class CollectiveMismatch(RuntimeError):
    """The ranks did not call the same collective (or one returned while the others waited in one)."""


class PeerFailed(RuntimeError):
    """Another rank raised while this one waited in a collective: that rank's error is the one to read."""


@dataclass
class _Call:
    op: str  # "reduce", "all_reduce", "broadcast", "all_gather_into_tensor"
    root: int | None
    tensors: tuple[torch.Tensor, ...]

    def __str__(self) -> str:
        t = self.tensors[-1]
        root = {"reduce": ", dst={}", "broadcast": ", src={}"}.get(self.op, "").format(self.root)
        return f"{self.op}({tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{root})"


class _Rendezvous:
    def __init__(self, group: ThreadGroup, timeout_s: float):
        self.group, self.world, self.timeout_s = group, group.world, timeout_s
        self.cond = threading.Condition()
        self.posted: dict[int, _Call] = {}
        self.generation = 0
        self.counts = [0] * self.world  # collectives each rank has called
        self.left: dict[int, str] = {}  # rank -> "returned" or "raised ..."
        self.error: BaseException | None = None

    def call(self, rank: int, call: _Call) -> None:
        with self.cond:
            self.counts[rank] += 1
            if self.error is None and self.left:
                self._stop(rank, call)
            if self.error is not None:
                raise self._fresh()
            self.posted[rank] = call
            generation = self.generation
            if len(self.posted) == self.world:
                calls, self.posted = [self.posted[r] for r in range(self.world)], {}
                try:
                    _same(calls, self.counts[rank])
                    self.group._do(calls)
                except CollectiveMismatch as err:
                    self.error = err
                    raise
                except BaseException as err:
                    self.error = PeerFailed(f"{calls[0]} failed on rank {rank}: {type(err).__name__}: {err}")
                    raise
                else:
                    self.generation += 1
                finally:
                    self.cond.notify_all()
                return
            while self.generation == generation and self.error is None:
                if not self.cond.wait(self.timeout_s):
                    self.error = CollectiveMismatch(f"rank {rank} waited {self.timeout_s:.0f} s in {call}; ranks "
                                                    f"{sorted(set(range(self.world)) - set(self.posted))} never "
                                                    "called it")
            if self.generation == generation:
                raise self._fresh()

    def _fresh(self) -> BaseException:
        """The group's error as a new exception for this rank (one object raised on two threads would carry both
        threads' frames)."""
        return type(self.error)(str(self.error))

    def _stop(self, rank: int, call: _Call) -> None:
        """A rank has left while `rank` is in (or calls) `call`: every waiting rank raises."""
        raised = {r: how for r, how in self.left.items() if how != "returned"}
        if raised:
            self.error = PeerFailed(", ".join(f"rank {r} {how}" for r, how in sorted(raised.items())))
        else:
            gone = ", ".join(f"rank {r} returned" for r in sorted(self.left))
            self.error = CollectiveMismatch(f"{gone} while rank {rank} called {call} (its collective number "
                                            f"{self.counts[rank]}): every rank must call the same collectives in "
                                            "the same order")
        self.cond.notify_all()

    def leave(self, rank: int, how: str) -> None:
        with self.cond:
            self.left[rank] = how
            if self.posted and self.error is None:
                waiting = min(self.posted)
                self._stop(waiting, self.posted[waiting])


def _same(calls: list[_Call], number: int) -> None:
    first = calls[0]
    for call in calls:
        shapes = [(tuple(t.shape), t.dtype) for t in call.tensors]
        if call.op != first.op or call.root != first.root or shapes != [(tuple(t.shape), t.dtype)
                                                                         for t in first.tensors]:
            said = "; ".join(f"rank {r} called {c}" for r, c in enumerate(calls))
            raise CollectiveMismatch(f"collective number {number}: {said}. Every rank must call the same "
                                     "collectives in the same order, with the same root and sizes")


class Comm:
    """One rank's view of the group: torch.distributed's calls (without the `dist.` prefix)."""

    def __init__(self, group: ThreadGroup, rendezvous: _Rendezvous, rank: int):
        self._group, self._rendezvous, self._rank = group, rendezvous, rank

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._group.world

    def reduce(self, tensor: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """Sum every rank's `tensor` into rank `dst`'s, in place; the other ranks' tensors are left as they were."""
        self._post("reduce", dst, (tensor,), op, group, async_op)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """Sum every rank's `tensor` into every rank's, in place."""
        self._post("all_reduce", None, (tensor,), op, group, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
        """Copy rank `src`'s `tensor` into every rank's."""
        self._post("broadcast", src, (tensor,), dist.ReduceOp.SUM, group, async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                               async_op: bool = False):
        """Every rank's `input_tensor`, in rank order, into every rank's `output_tensor` (world x its size)."""
        if output_tensor.numel() != self._group.world * input_tensor.numel() or \
                output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"rank {self._rank}: all_gather_into_tensor needs an output of world size "
                             f"({self._group.world}) x the input's elements and the same dtype: output "
                             f"{tuple(output_tensor.shape)} {output_tensor.dtype}, input "
                             f"{tuple(input_tensor.shape)} {input_tensor.dtype}")
        self._post("all_gather_into_tensor", None, (output_tensor, input_tensor), dist.ReduceOp.SUM, group,
                   async_op)

    def _post(self, op: str, root, tensors, reduce_op, group, async_op) -> None:
        if async_op or group is not None or reduce_op != dist.ReduceOp.SUM:
            raise ValueError(f"ThreadGroup's {op} runs synchronously on the whole group with SUM: leave async_op, "
                             "group and op at their defaults")
        world = self._group.world
        if root is not None and not (isinstance(root, int) and 0 <= root < world):
            raise ValueError(f"rank {self._rank}: {op} got root {root!r}; ranks are 0 to {world - 1}")
        dev = self._group.devices[self._rank]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not dev.is_device(t):
                what = type(t).__name__ if not isinstance(t, torch.Tensor) else "a host tensor"
                raise ValueError(f"rank {self._rank}: {op} got {what}; a collective takes tensors on the rank's own "
                                 "device (NCCL sums and gathers device buffers): copy it to the device first, or "
                                 "count it there with dev.adopt")
        stream = self._group._streams[self._rank]
        if stream is None:
            self._rendezvous.call(self._rank, _Call(op, root, tuple(tensors)))
            return
        reads = tensors[1:] if op == "all_gather_into_tensor" else tensors
        dev.hazards.stream_waits_for_host(stream)  # runs in compute's order, after its waits
        clock = dev.hazards.issue(stream)
        try:
            dev.hazards.access(stream, clock, list(reads), [], f"the {op}")
        except HazardError as err:
            detail = str(err).split(" reads ", 1)[-1].split(": nothing orders")[0]
            raise HazardError(f"rank {self._rank}: the {op} reads {detail}. A collective runs in the compute's order, "
                              "not after other streams' work: make the compute wait for the copy's event "
                              "(dev.compute_waits_for(event)) before the collective") from None
        self._rendezvous.call(self._rank, _Call(op, root, tuple(tensors)))
        dev.hazards.host_waits(clock)  # done when the call returns: later work is ordered after it


class ThreadGroup:
    """`world` ranks on threads, each with its own sim device (`devices[rank]`, options as device("sim", ...)).
    A context manager: the devices are closed on exit."""

    def __init__(self, world: int, **sim_options):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        self.world = world
        self.devices = [device("sim", **sim_options) for _ in range(world)]
        # strict devices: the collectives' reads are checked against copies still in flight on other streams
        self._streams = [dev.stream("collectives") if dev.hazards else None for dev in self.devices]
        self.summed = [0] * world  # bytes of sums delivered to each rank
        self.received = [0.0] * world  # bytes that reached each rank from the others (ring algorithms)
        self.calls: list[list[str]] = [[] for _ in range(world)]

    def run(self, fn: Callable, timeout_s: float = TIMEOUT_S) -> list:
        """fn(rank, comm) on every rank at once; returns the results in rank order, or raises the first rank's
        error (a rank's own error before one that only stopped because of it)."""
        rendezvous = _Rendezvous(self, timeout_s)
        results: list = [None] * self.world
        errors: dict[int, BaseException] = {}

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(rank, self._comm(rendezvous, rank))
            except BaseException as err:
                errors[rank] = err
                rendezvous.leave(rank, f"raised {type(err).__name__}")
            else:
                rendezvous.leave(rank, "returned")

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank {r}", daemon=True)
                   for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = [errors[r] for r in sorted(errors) if not isinstance(errors[r], PeerFailed)]
            raise (first or [errors[min(errors)]])[0]
        return results

    def _comm(self, rendezvous: _Rendezvous, rank: int) -> Comm:
        """What rank `rank` calls its collectives on during one run (built on that rank's thread)."""
        return Comm(self, rendezvous, rank)

    def _do(self, calls: list[_Call]) -> None:
        """Run one collective for every rank (on the thread of the last rank to arrive; the others wait)."""
        world, op, root = self.world, calls[0].op, calls[0].root
        nbytes = calls[0].tensors[0].numel() * calls[0].tensors[0].element_size()
        for rank, call in enumerate(calls):
            self.calls[rank].append(str(call))
        if op in ("reduce", "all_reduce"):
            total = calls[0].tensors[0].clone()
            for call in calls[1:]:
                total += call.tensors[0]  # in rank order: the same bits every run
            for rank in ([root] if op == "reduce" else range(world)):
                calls[rank].tensors[0].copy_(total)
                self.summed[rank] += nbytes
            for rank in range(world):
                if op == "all_reduce":
                    self.received[rank] += 2 * (world - 1) * nbytes / world
                elif world > 1 and rank != (root + 1) % world:
                    self.received[rank] += nbytes
        elif op == "broadcast":
            source = calls[root].tensors[0].clone()
            for rank, call in enumerate(calls):
                if rank != root:
                    call.tensors[0].copy_(source)
                    self.received[rank] += nbytes
        else:  # all_gather_into_tensor: every input first (an input may be a slice of an output)
            gathered = torch.cat([call.tensors[1].reshape(-1).clone() for call in calls])
            for rank, call in enumerate(calls):
                call.tensors[0].view(-1).copy_(gathered)
                self.received[rank] += (world - 1) * nbytes / world

    def close(self) -> None:
        errors = []
        for dev in self.devices:
            try:
                dev.close()
            except Exception as err:  # close every device; report the first error after
                errors.append(err)
        if errors:
            raise errors[0]

    def __enter__(self) -> ThreadGroup:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # the run's own error is already on its way up
                pass
