"""N ranks on threads of one Python process, talking through real gloo process groups: the capstone's ranks.

    with GlooGroup(2) as group:                        # group.devices[r] is rank r's SimDevice
        results = group.run(lambda rank, comm: work(comm, group.devices[rank]))

Lab 10's `ThreadGroup` runs the ranks on threads and does each collective itself. Here every rank builds its own
`ProcessGroupGloo` (torch.distributed's gloo backend, the one the engine uses with the sim) over a shared in-process
store, and every collective is gloo's: the bytes cross the loopback in gloo's rings, as they do between the
processes `torchrun` starts. A notebook's functions can run on these ranks because the ranks are threads, not
spawned processes. Before each collective the ranks still meet as in `ThreadGroup` (lab10_ranks.py), so ranks that
call different collectives get `CollectiveMismatch` naming what each called instead of a hang; on strict devices a
collective that reads a buffer a copy may still be writing raises `HazardError`, as in Lab 10.

`comm` offers `reduce_scatter_tensor(out, inp)` (rank r gets the sum of everyone's `inp[r*k:(r+1)*k]`) and
`all_gather_into_tensor(out, inp)`, besides Lab 10's `reduce`, `all_reduce` and `broadcast`; `received[r]` counts
the bytes that reached rank r from the others in NCCL's and gloo's ring algorithms ((N-1)/N of the full buffer for
an all-gather or a reduce-scatter).

What this is not: a launcher (torchrun is), a model of the network's time, or async collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ...devices.hazards import HazardError
from .lab10_ranks import TIMEOUT_S, Comm, ThreadGroup, _Call, _Rendezvous

__all__ = ["GlooComm", "GlooGroup"]


class GlooComm(Comm):
    """One rank's view: torch.distributed's calls (without `dist.`), each run on this rank's gloo group."""

    def __init__(self, group: GlooGroup, rendezvous: _Rendezvous, rank: int, gloo):
        super().__init__(group, rendezvous, rank)
        self._gloo = gloo

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                              async_op: bool = False):
        """Sum every rank's `input` (world x output's size); rank r keeps the sum of slice r in `output`."""
        if input.numel() != self._group.world * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"rank {self._rank}: reduce_scatter_tensor needs an input of world size "
                             f"({self._group.world}) x the output's elements and the same dtype: output "
                             f"{tuple(output.shape)} {output.dtype}, input {tuple(input.shape)} {input.dtype}")
        self._post("reduce_scatter_tensor", None, (output, input), op, group, async_op)

    def _post(self, op: str, root, tensors, reduce_op, group, async_op) -> None:
        if async_op or group is not None or reduce_op != dist.ReduceOp.SUM:
            raise ValueError(f"GlooGroup's {op} runs synchronously on the whole group with SUM: leave async_op, "
                             "group and op at their defaults")
        world, dev = self._group.world, self._group.devices[self._rank]
        if root is not None and not (isinstance(root, int) and 0 <= root < world):
            raise ValueError(f"rank {self._rank}: {op} got root {root!r}; ranks are 0 to {world - 1}")
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not dev.is_device(t):
                what = type(t).__name__ if not isinstance(t, torch.Tensor) else "a host tensor"
                raise ValueError(f"rank {self._rank}: {op} got {what}; a collective takes tensors on the rank's own "
                                 "device (NCCL sums and gathers device buffers): copy it to the device first, or "
                                 "count it there with dev.adopt")
        stream = self._group._streams[self._rank]
        clock = None
        if stream is not None:
            reads = tensors[1:] if len(tensors) > 1 else tensors
            dev.hazards.stream_waits_for_host(stream)  # runs in compute's order, after its waits
            clock = dev.hazards.issue(stream)
            try:
                dev.hazards.access(stream, clock, list(reads), [], f"the {op}")
            except HazardError as err:
                detail = str(err).split(" reads ", 1)[-1].split(": nothing orders")[0]
                raise HazardError(f"rank {self._rank}: the {op} reads {detail}. A collective runs in the compute's "
                                  "order, not after other streams' work: make the compute wait for the copy's event "
                                  "(dev.compute_waits_for(event)) before the collective") from None
        self._rendezvous.call(self._rank, _Call(op, root, tuple(tensors)))  # every rank is here, with the same call
        self._gloo_call(op, root, tensors).wait()
        if clock is not None:
            dev.hazards.host_waits(clock)  # done when the call returns: later work is ordered after it

    def _gloo_call(self, op: str, root, tensors):
        gloo = self._gloo
        if op == "reduce":
            options = dist.ReduceOptions()
            options.rootRank = root
            return gloo.reduce([tensors[0]], options)
        if op == "broadcast":
            options = dist.BroadcastOptions()
            options.rootRank = root
            return gloo.broadcast([tensors[0]], options)
        if op == "all_reduce":
            return gloo.allreduce([tensors[0]])
        if op == "all_gather_into_tensor":
            return gloo._allgather_base(tensors[0], tensors[1])
        return gloo._reduce_scatter_base(tensors[0], tensors[1])


class GlooGroup(ThreadGroup):
    """`world` ranks on threads, each with its own sim device (`devices[rank]`, options as device("sim", ...)) and its
    own gloo process group for each `run`. A context manager: the devices are closed on exit."""

    def __init__(self, world: int, **sim_options):
        super().__init__(world, **sim_options)
        self._store = dist.HashStore()
        self._runs = 0

    def run(self, fn: Callable, timeout_s: float = TIMEOUT_S) -> list:
        """fn(rank, comm) on every rank at once, each rank with a gloo process group of its own for this run; returns
        the results in rank order, or raises the first rank's error (as ThreadGroup.run)."""
        self._runs += 1
        self._run_store = dist.PrefixStore(f"run {self._runs}", self._store)
        self._timeout_s = timeout_s
        return super().run(fn, timeout_s)

    def _comm(self, rendezvous: _Rendezvous, rank: int) -> GlooComm:
        gloo = dist.ProcessGroupGloo(self._run_store, rank, self.world, timedelta(seconds=self._timeout_s))
        return GlooComm(self, rendezvous, rank, gloo)

    def _do(self, calls: list[_Call]) -> None:
        """Every rank has arrived with the same call: count what it will deliver (gloo moves the bytes after)."""
        world, op, root = self.world, calls[0].op, calls[0].root
        nbytes = calls[0].tensors[0].numel() * calls[0].tensors[0].element_size()
        for rank, call in enumerate(calls):
            self.calls[rank].append(str(call))
            if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                full = call.tensors[0 if op == "all_gather_into_tensor" else 1]
                self.received[rank] += (world - 1) * full.numel() * full.element_size() / world
            elif op == "all_reduce":
                self.received[rank] += 2 * (world - 1) * nbytes / world
                self.summed[rank] += nbytes
            elif op == "broadcast" and rank != root:
                self.received[rank] += nbytes
            elif op == "reduce":
                self.summed[rank] += nbytes if rank == root else 0
                self.received[rank] += nbytes if world > 1 and rank != (root + 1) % world else 0
