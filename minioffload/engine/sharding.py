"""Sharded offload across ranks (chapter 10): each rank owns some subgroups; the others only pass through it.

    dist.init_process_group("gloo")                 # torchrun sets RANK and WORLD_SIZE; "nccl" on CUDA
    opt = OffloadAdam(model.parameters(), dev, shard=Shard(timeout_s=60))

ZeRO-2 with CPU offload, with whole subgroups as the shards (`layout.shard_owners` balances them by size):
- backward: when a subgroup's last gradient has arrived, its gradients are packed into one flat device buffer
  and summed into its owner (`reduce`: a reduce-scatter whose shards are subgroups). Only the owner copies it
  to the host, so each rank's link carries 1/N of the gradients and each rank holds 1/N of the optimizer state.
- step: each rank runs the CPU Adam on its own subgroups and sends their new weights up in one copy per
  subgroup; each subgroup is then broadcast from its owner (an all-gather whose shards are subgroups).
  `WeightGather` issues the broadcasts in subgroup order on every rank without waiting, so the ranks update
  their own subgroups at the same time and each waits only for the weights it needs next.
- the clip norm comes from per-subgroup partial sums placed by their owners and added in subgroup order, as
  one process adds them: the coefficient, and so the weights, are bitwise those of one process.

Device tensors travel on the group's backend (gloo with the simulated device, whose memory is host memory;
NCCL on CUDA); small host values (norm partials, flags, the settings check) on a gloo group. Every rank issues
the same collectives in the same order (sharded.py holds back gradients that complete early to keep it so).

Every collective has the process group's timeout, but what a failure does depends on the backend:
- gloo (the sim, and host values on CUDA): the waiting call raises; a rank that died or diverged becomes an error
  naming the rank and the collective, on every rank still alive, rather than a hang.
- NCCL: a collective is queued on the GPU and the host does not wait for it (a broadcast's `work.wait()` only
  makes the current stream wait; waiting with a timeout would make the host poll until the collective ends, which
  is what the overlap is for). A collective that fails or outlives the timeout is caught by ProcessGroupNCCL's
  watchdog thread, not at a wait: it tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default 3
  leaves the communicator as it is; torchrun's default 1 aborts it first), and torchrun then stops the other
  ranks. With TORCH_NCCL_BLOCKING_WAIT=1 the host waits for every NCCL collective and the error is raised at the
  wait, as with gloo, at the cost of the overlap.

What this is not: ZeRO-3 (the weights are whole on every rank between steps; streaming them in shards is not
done here), a data loader (each rank feeds its own batches), or a launcher (torchrun is).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..layout import shard_owners

DEFAULT_TIMEOUT_S = 120.0


def init(device_kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes (env:// rendezvous): gloo for the sim, NCCL for CUDA."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def leave(wait_for_all: bool = True) -> None:
    """Leave the process group `init` joined (the end of a run). `wait_for_all`: first meet every rank at a barrier,
    so that no rank tears its connections down while another still uses them (leave it off after an error, when
    the others may never arrive)."""
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()


class Shard:
    """This rank's place in the group, who owns which subgroup, and the collectives that move gradients to
    owners and weights from them. `group`: a torch.distributed group (default: the world)."""

    def __init__(self, group=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not dist.is_initialized():
            raise ValueError("Shard needs torch.distributed initialised: launch with torchrun and call "
                             "dist.init_process_group (or minioffload.engine.sharding.init) first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = dist.get_backend(self.group)  # of the device tensors' collectives: "gloo" or "nccl"
        # host-side values need a CPU backend: with NCCL, a gloo group beside it
        self.host_group = (self.group if self.backend == "gloo"
                           else dist.new_group(backend="gloo", timeout=self.timeout))
        self.owners: list[int] = []
        self.link_bytes = {"d2h": 0, "h2d": 0}  # over this rank's own link, counted by the engine
        self.net_bytes = 0  # this rank's device buffers in collectives (reduce and broadcast payloads)

    def assign(self, sizes: list[int]) -> list[int]:
        """Own subgroups of `sizes` elements: every rank must get at least one (else say how to fix it)."""
        owners = shard_owners(sizes, self.world)
        idle = sorted(set(range(self.world)) - set(owners))
        if idle:
            raise ValueError(f"{len(sizes)} subgroups cannot be shared by {self.world} ranks (ranks {idle} would own "
                             "none): lower subgroup_numel so there are at least as many subgroups as ranks, or "
                             "run fewer ranks")
        self.owners = owners
        return owners

    def mine(self, index: int) -> bool:
        return self.owners[index] == self.rank

    def check_same(self, settings: dict) -> None:
        """Every rank must run the same settings: a ValueError on every rank names the first rank and setting
        that differ from rank 0's (the same message everywhere, so no rank is left waiting)."""
        everyone: list = [None] * self.world
        self._run(f"the settings check ({', '.join(settings)})",
                  lambda: dist.all_gather_object(everyone, settings, group=self.host_group))
        for rank, theirs in enumerate(everyone):
            for key in settings:
                if theirs.get(key) != everyone[0].get(key):
                    raise ValueError(f"rank {rank} has {key}={_short(theirs.get(key))}, rank 0 has "
                                     f"{_short(everyone[0].get(key))}: every rank must be started with the same "
                                     "settings")

    # gradients: summed into their owner --------------------------------------------------------
    def reduce(self, flat: torch.Tensor, index: int) -> None:
        """Sum every rank's `flat` (subgroup `index`'s gradients) into its owner's, in place."""
        self.net_bytes += flat.numel() * flat.element_size()
        self._run(f"the reduce of subgroup {index}'s gradients to rank {self.owners[index]}",
                  lambda: dist.reduce(flat, dst=_global(self.group, self.owners[index]), group=self.group))

    def broadcast_host(self, tensor: torch.Tensor | None, numel: int, index: int) -> torch.Tensor:
        """Subgroup `index`'s fp32 host `tensor` (given by its owner; None elsewhere), on every rank."""
        buffer = tensor.clone() if self.mine(index) else torch.empty(numel)
        self._run(f"the broadcast of subgroup {index}'s master weights from rank {self.owners[index]}",
                  lambda: dist.broadcast(buffer, src=_global(self.host_group, self.owners[index]),
                                         group=self.host_group))
        return buffer

    # small host values --------------------------------------------------------------------------
    def sum_in_order(self, partials: dict[int, float], count: int) -> float:
        """Sum of per-subgroup values, each given by its owner (`partials`: index -> value), added in subgroup
        order from zero: the same float64 arithmetic as one process summing them all."""
        values = torch.zeros(count, dtype=torch.float64)
        for index, value in partials.items():
            values[index] = value
        self._run("the all-reduce of the gradient norm's partial sums",
                  lambda: dist.all_reduce(values, group=self.host_group))  # x + 0.0 is exact: each owner's value
        return sum(values.tolist())

    def all_true(self, flag: bool) -> bool:
        """True on every rank when it is true on every rank (the overflow check)."""
        value = torch.tensor([0 if flag else 1], dtype=torch.int32)
        self._run("the overflow flag's all-reduce", lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX,
                                                                           group=self.host_group))
        return not bool(value.item())

    def mean(self, value: float) -> float:
        """The mean of a number over the ranks (a step's loss)."""
        total = torch.tensor([value], dtype=torch.float64)
        self._run("the all-reduce of a number", lambda: dist.all_reduce(total, group=self.host_group))
        return float(total.item()) / self.world

    def gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's list of integers (as long on every rank), in rank order, on every rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        self._run(f"the gather of {what}", lambda: dist.all_gather(everyone, mine, group=self.host_group))
        return [row.tolist() for row in everyone]

    def gather(self, value) -> list:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        everyone: list = [None] * self.world
        self._run("the gather of every rank's figures",
                  lambda: dist.all_gather_object(everyone, value, group=self.host_group))
        return everyone

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """Sum a device tensor over every rank, in place (gradients kept on the device)."""
        self.net_bytes += tensor.numel() * tensor.element_size()
        self._run(f"the all-reduce of {what}", lambda: dist.all_reduce(tensor, group=self.group))

    def _run(self, what: str, collective):
        try:
            return collective()
        except Exception as err:  # gloo and NCCL say "timed out" or "connection closed": name the collective
            raise RuntimeError(f"rank {self.rank} of {self.world}: {what} failed ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}). Another rank died, timed out "
                               f"after {self.timeout.total_seconds():.0f} s, or called a different collective: "
                               "look for the first error in the other ranks' output") from err


class WeightGather:
    """Broadcast each subgroup's new weights from its owner, in subgroup order, without waiting: at most
    `in_flight` broadcasts pending (each holds a flat buffer); as each ends, `write(slots, flat)` puts the weights
    in the model; `finish()` waits for the rest. A flat buffer is on the device, or in host memory (`on_host`: on the
    host group) for weights whose home is there.

    The owner passes its uploaded buffer (after the upload's event), the others a fresh one the broadcast fills;
    once it is done, every rank copies the buffer into the parameters. Every rank issues the same broadcasts in
    the same order."""

    def __init__(self, shard: Shard, dev, write, in_flight: int):
        self.shard, self.dev, self.write, self.in_flight = shard, dev, write, max(1, in_flight)
        self.pending: deque = deque()

    def send(self, index: int, flat: torch.Tensor, slots, on_host: bool = False) -> None:
        """This rank owns subgroup `index`: `flat` holds its new weights (an upload into it has landed)."""
        self._issue(index, flat, slots, on_host)

    def receive(self, index: int, numel: int, dtype: torch.dtype, slots, on_host: bool = False) -> None:
        flat = self.dev.host_empty(numel, dtype) if on_host else self.dev.empty(numel, dtype, "weights in flight")
        self._issue(index, flat, slots, on_host)

    def _issue(self, index, flat, slots, on_host: bool) -> None:
        while len(self.pending) >= self.in_flight:
            self._complete()
        shard = self.shard
        shard.net_bytes += flat.numel() * flat.element_size()
        owner = self.shard.owners[index]
        group = shard.host_group if on_host else shard.group
        work = shard._run(f"the broadcast of subgroup {index}'s weights from rank {owner}",
                          lambda: dist.broadcast(flat, src=_global(group, owner), group=group, async_op=True))
        on_device = not on_host and shard.backend != "gloo"  # an NCCL collective, queued on the GPU
        self.pending.append((index, work, flat, slots, on_device))

    def _complete(self) -> None:
        index, work, flat, slots, on_device = self.pending.popleft()
        owner = self.shard.owners[index]
        # NCCL: no timeout, so the host does not poll: the current stream waits for the broadcast, the write below
        # is queued after it, and the span is only the wait's queuing (NCCL's watchdog keeps the group's timeout)
        wait = work.wait if on_device else lambda: work.wait(self.shard.timeout)
        with self.dev.trace.span("net", f"broadcast {index}", flat.numel() * flat.element_size()):
            self.shard._run(f"the broadcast of subgroup {index}'s weights from rank {owner}", wait)
        self.write(slots, flat)

    def finish(self) -> None:
        while self.pending:
            self._complete()


def settings_of(options, param_groups: list[dict], slots, subgroups: list, nvme: bool) -> dict:
    """What must match across ranks for sharded offload to make sense: options, hyper-parameters, the model's
    shapes and dtypes, the subgroup sizes."""
    return {"options": dataclasses.asdict(options),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
            "parameters": [(tuple(s.param.shape), str(s.param.dtype)) for s in slots],
            "subgroups": [sub.numel for sub in subgroups],
            "nvme": nvme}


def _global(group, rank: int) -> int:
    """A group rank as the global rank torch.distributed's src/dst arguments take."""
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
