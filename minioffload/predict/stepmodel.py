"""A model of one training step: predict its timeline, its length, the resource that bounds it, and what is exposed.

    work = Workload(num_params=7e9, tokens=8 * 4096, num_tensors=291)
    pred = predict(work, profiles.preset("h100-sxm"), StepConfig(delay_updates_after=0))
    pred.step_s, pred.bound, pred.exposed      # seconds; "cpu"; {"cpu": 2.1, "h2d": 0.0, ...}
    course.viz.timeline(pred.trace)             # the same lanes a measured run records

The step is built as the runtime runs it: a list of operations, each on a lane ("compute", "d2h", "h2d",
"cpu", "nvme_read", "nvme_write"), with a duration from the hardware profile and the operations it waits
for. A list scheduler (schedule.py) places each operation at the earliest time its inputs are ready and its resource is
free. Durations, per operation:

    forward  2 N T / (peak x mfu)          backward  4 N T / (peak x mfu)  (+ 2 N T for a recomputed forward)
    a copy   latency + bytes / link        CPU Adam  subgroup_overhead + n / cpu_adam_rate (per subgroup)
    other host passes  bytes / host_bandwidth
    disk     per-file cost + bytes / nvme_read or write (one file per subgroup's state, per streamed block)
    a collective  collective_latency + bytes sent / interconnect      device Adam  n / device_adam_rate
    host time on the compute thread: grad_hook_overhead per gradient the engine's hook takes, copy_overhead per
    copy a hook issues, fetch_overhead per streamed block fetched

Which resources are one: each lane is its own resource, except that reads and writes share one drive, and
on a `shared_host` profile (the simulated device) the device's compute and the CPU's work run on the same
cores, so they queue behind each other instead of overlapping. Host DRAM is shared by the CPU's passes and by
every DMA to or from host memory (link copies, disk reads and writes): the step is no shorter than all those
bytes over `host_bandwidth` (the "host memory" bound, which the chapter 5 paper observes as PCIe transfers
contending with the CPU update). Several steps are simulated and the last one is reported, so a delayed update
that spills into the next step is counted as it would be in a long run.

Copies: a gradient leaves the device in one copy per tensor, or with `bucket_numel` in one copy per bucket (a
subgroup's tensors packed in order into buckets of at most that many elements, a larger tensor alone), each bucket
leaving when its last gradient is ready, after a device-side gather of its gradients (bytes / device_bandwidth).
New weights go up in one copy per subgroup. Speculative update (`speculative`, issue 19): each subgroup's CPU update
runs on a worker as soon as its gradients are on the host, in the order they arrive, during backward; after
backward only the validation (the global norm combined from per-subgroup sums, when clipping) and the updates
still running stand between the step and the next forward. The model predicts the common case: nothing redone.

Streamed parameters (chapter 8, `params_on="host"` or `"nvme"`): the blocks' weights live off the device. Forward
and backward run block by block (backward in reverse); each block's compute waits for its fetch (an H2D copy, after
an NVMe read with the "nvme" home), and the fetch of the v-th block visited may not start before the (v - k - 1)-th
has finished computing (k = `prefetch`: at most k + 1 blocks on the device); a block whose backward comes within k
uses of its forward is kept, not fetched again (model/streaming.py's rule). Weights outside the blocks stay
resident and their FLOPs are counted at the LM head, between forward and backward. After the update nothing is
uploaded: the CPU rounds the master into the host home (no pass for fp32: the master is the home) or writes the
rounded weights to NVMe. `Prediction.exposed_fetch_s` is the fetch time not hidden under compute. Not modelled:
the runtime's prefetches of the next step's first blocks during the last backward, which its optimizer step drops.

Gradients on NVMe (`placement.grads_on="nvme"`, chapter 12): each subgroup, once its last gradient copy has landed
(in backward's order), is summed on the host and its fp32 gradient written to the drive (4 B/param on the write
lane); the update waits for every write, and each subgroup's read brings its gradient with its state (16 B/param).
One micro-batch: the planner adds each extra micro-batch's read and write of the partial sums.

Ranks (`StepConfig.placement.ranks`): each rank's micro-batch computes alike (one "compute" lane stands for all);
after each subgroup's backward its gradient is reduced to its owner (shards.shard_owners) on the "net" lane, one
communicator whose collectives run in issue order, each taking collective_latency + shards.ring_bytes / interconnect;
the rest of the backward waits for each reduce (the runtime calls it from the gradient hook, and the call blocks).
Only the owner copies it out, sums, clips (the partial norms all-reduced) and updates it on its own cores, and uploads
it; then its owner broadcasts it. Rank r > 0's lanes are named "d2h:r", "cpu:r", ...; the trace shows rank 0's.
Without offload the ranks all-reduce each subgroup-sized bucket of gradients. On a shared host (the sim) the ranks
share its cores: their compute is ranks x longer and every rank's CPU work queues on the one "host".

What this is not: a simulator of kernels or of an allocator. It knows the runtime's configurations
(on-device, optimizer offload, delayed update, hybrid split, NVMe tier, streamed parameters) and the byte counts
each moves; it ignores Python overheads, caches, and everything the profile does not name.
"""

from __future__ import annotations

import gc
import math

from ..layout import STATE_BYTES_PER_PARAM, device_subgroups
from ..machine.profiles import ADAM_BYTES_PER_PARAM, Hardware
from ..trace import Trace
from .hybrid_split import scratch_sets
from .prediction import Prediction, _on, _prediction, rank_of, resource_of
from .prediction import compare as compare  # re-exported: callers import them from here
from .schedule import Plan, schedule
from .shards import ring_bytes, shard_owners
from .step_config import StepConfig, Workload, pack_buckets

# Bytes per parameter of the host passes the engine makes besides Adam (engine/optimizer.py):
ACCUMULATE_BYTES = 8  # grad (fp32) += staging: read 4 + write 4, plus the staging's own bytes (model dtype)
CLIP_BYTES = 12  # global norm: one read (gradnorm.sum_of_squares, 4); then grad *= coef (4 + 4)
ZERO_BYTES = 4  # grad.zero_() after the update
DEVICE_PATH_BYTES = 8  # hybrid device path besides Adam: gather the gradients into fp32 (write 4) and read the
#                       master to write the weights (read 4); plus the gradient read and the weight write, each in
#                       the model's dtype


class _Builder:
    """The operations of one step of each configuration, in the runtime's order."""

    def __init__(self, work: Workload, hw: Hardware, config: StepConfig):
        self.work, self.hw, self.config, self.plan = work, hw, config, Plan()
        self.ranks = config.placement.ranks
        flops = hw.peak_flops(work.precision) * config.mfu
        if hw.shared_host:  # the sim: every rank's forward and backward run on the same cores
            flops /= config.placement.ranks
        n, t = work.num_params, work.tokens
        self.forward_s = 2 * n * t / flops
        self.backward_s = (4 + 2 * work.recompute) * n * t / flops
        self.groups = work.subgroups(config.options.subgroup_numel)
        self.owners = shard_owners([params for params, _ in self.groups], config.placement.ranks)
        self.job: dict[int, int] = {}  # delayed update: each rank's background update's last op
        self.entry: dict[int, int] = {}  # each rank's last step()'s start: its gradients have arrived
        self.state_home = None  # hybrid: the last streamed state copied back to the host
        self.arrived: dict[int, int] = {}  # each offloaded subgroup's last gradient copy (this step's)
        self.grads_made: dict[int, int] = {}  # each subgroup's end of backward (this step's)
        self.last_compute: int | None = None  # the last backward piece added

    def copy(self, direction: str, nbytes: float, copies: int, name: str, deps, stream: str, rank: int = 0) -> int:
        link = self.hw.link_h2d if direction == "h2d" else self.hw.link_d2h
        # DMA touches host memory once; on a shared host (the sim) a "copy" is a memcpy that reads and writes it
        return self.plan.add(_on(direction, rank), name, copies * self.hw.link_latency + nbytes / link, deps, nbytes,
                             _on(stream, rank), host_bytes=nbytes * (2 if self.hw.shared_host else 1))

    def host(self, name: str, bytes_per_param: float, params: float, deps, stream: str = "host", issue: int = 0,
             rank: int = 0) -> int:
        """A pass over host memory, plus the host time to issue `issue` copies after it."""
        seconds = params * bytes_per_param / self.hw.host_bandwidth + issue * self.hw.copy_overhead
        return self.plan.add(_on("cpu", rank), name, seconds, deps, stream=_on(stream, rank),
                             host_bytes=params * bytes_per_param)

    def collective(self, kind: str, nbytes: float, name: str, deps) -> int:
        """A ring collective of `nbytes` on the interconnect, in issue order on one communicator ("net"): a fixed cost
        (`collective_latency`) and the bytes each rank sends (shards.ring_bytes) over `interconnect`."""
        sent = ring_bytes(kind, nbytes, self.ranks)
        return self.plan.add("net", name, self.hw.collective_latency + sent / self.hw.interconnect, deps, sent, "net")

    def grad_copies(self, params: float, tensors: int) -> list[tuple[float, int, int, float]]:
        """(params, tensors, copies, gathered params) of the pieces in which `tensors` equal gradients of `params`
        leave the device, in the order backward finishes them: one piece of `tensors` copies (one per tensor); with
        bucket_numel one copy per bucket, the last bucket first (backward runs the layers in reverse), its
        gradients gathered into the bucket on the device unless it holds one tensor alone (engine/buckets.py)."""
        if self.config.options.bucket_numel is None:
            return [(params, tensors, tensors, 0.0)]
        buckets = pack_buckets([params / tensors] * tensors, self.config.options.bucket_numel)
        return [(sum(bucket), len(bucket), 1, sum(bucket) if len(bucket) > 1 else 0.0) for bucket in reversed(buckets)]

    def copies_of(self, params: float, tensors: int) -> tuple[int, float]:
        """The copies and the gathered parameters of `grad_copies`, summed over its pieces."""
        pieces = self.grad_copies(params, tensors)
        return sum(copies for _, _, copies, _ in pieces), sum(gathered for _, _, _, gathered in pieces)

    def hooks(self, tensors: int, copies: int, gathered: float) -> float:
        """Seconds the gradient hooks add to a piece of backward: the engine's hook for each of `tensors` gradients,
        the host's time to issue `copies` copies, and the device-side gather of `gathered` parameters' gradients
        into their buckets."""
        gather = 2 * gathered * self.work.model_bytes  # read and write, in the model's dtype
        return (tensors * self.hw.grad_hook_overhead + copies * self.hw.copy_overhead
                + gather / self.hw.device_bandwidth)

    def backward_piece(self, params: float, tensors: int, copies: int, gathered: float) -> int:
        """The backward of `params` parameters with its hooks (the gather is a host memcpy on a shared host)."""
        work, hw = self.work, self.hw
        seconds = self.backward_s * params / work.num_params + self.hooks(tensors, copies, gathered)
        return self.plan.add("compute", "backward", seconds, [self.last_compute], stream="compute",
                             host_bytes=2 * gathered * work.model_bytes if hw.shared_host else 0.0)

    def forward_backward(self, after: int | None) -> tuple[int, dict[int, list[int]]]:
        """Forward, then backward in pieces, each piece's gradient reduced to its owner (ranks > 1) and copied out
        there (offloaded CPU subgroups only); without offload, ranks > 1 all-reduce each piece's gradient (buckets)."""
        plan, mb, groups = self.plan, self.work.model_bytes, self.groups
        forward = plan.add("compute", "forward", self.forward_s, [after], stream="compute")
        if not self.config.placement.offloaded and self.ranks == 1:
            return plan.add("compute", "backward", self.backward_s, [forward], stream="compute"), {}
        on_cpu = self.cpu_groups() if self.config.placement.offloaded else set()
        copies: dict[int, list[int]] = {rank: [] for rank in range(self.ranks)}
        self.last_compute = forward
        for index in reversed(range(len(groups))):  # backward produces the last layers' gradients first
            params, tensors = groups[index]
            pieces = self.grad_copies(params, tensors) if index in on_cpu else [(params, 0, 0, 0.0)]
            done = []
            for piece, piece_tensors, piece_copies, gathered in pieces:
                self.last_compute = self.backward_piece(piece, piece_tensors, piece_copies, gathered)
                done.append(self.last_compute)
            self.grads_made[index] = done[-1]
            if self.ranks > 1:  # the subgroup's gradient, reduced to its owner, leaves from there
                kind = "reduce" if self.config.placement.offloaded else "all_reduce"
                done = [self.collective(kind, params * mb, f"{kind.replace('_', '-')} grad", [done[-1]])] * len(done)
                # the runtime's reduce is a blocking call from the gradient hook: the host thread (gloo) or the
                # compute stream (NCCL) waits for it, so the rest of the backward runs after it
                self.last_compute = done[-1]
                if not self.config.placement.offloaded:
                    copies[0].append(done[0])
            if index in on_cpu:
                owner = self.owners[index]
                for (piece, _, piece_copies, _), ready in zip(pieces, done, strict=True):
                    copies[owner].append(self.copy("d2h", piece * mb, piece_copies, "d2h grad", [ready], "d2h", owner))
                self.arrived[index] = copies[owner][-1]
        return self.last_compute, copies

    def streamed_forward_backward(self, after: int | None) -> tuple[int, list[int]]:
        """Block by block: forward 0..L-1, the resident head, backward L-1..0; each block fetched before it runs
        (within the window of prefetch + 1 blocks) and its gradient copied out after its backward. As the runtime
        does, a block whose backward is among the next `prefetch` uses after its forward stays (the last
        (prefetch + 1) // 2 blocks turn into the backward without a second fetch)."""
        plan, work, hw, mb = self.plan, self.work, self.hw, self.work.model_bytes
        layers, window = work.num_layers, self.config.placement.prefetch + 1
        block, head = work.block_params, work.resident_params
        block_tensors = max(1, round(work.num_tensors * block / work.num_params))
        head_tensors = max(1, work.num_tensors - layers * block_tensors)
        # each block's gradients in buckets, counted per block: copies, and the parameters gathered into buckets
        block_copies, block_gathered = self.copies_of(block, block_tensors)
        head_copies, head_gathered = self.copies_of(head, head_tensors) if head else (0, 0.0)
        visits = [*((False, i) for i in range(layers)), *((True, i) for i in reversed(range(layers)))]
        computes, copies, last = [], [], after
        for v, (backward, i) in enumerate(visits):
            if backward and i == layers - 1:  # the head, between forward and backward, with the weights it keeps
                last = plan.add("compute", "forward head", self.forward_s * head / work.num_params, [last],
                                stream="compute")
                last = plan.add("compute", "backward head", self.backward_s * head / work.num_params
                                + self.hooks(head_tensors if head else 0, head_copies, head_gathered), [last],
                                stream="compute")
                if head:
                    copies.append(self.copy("d2h", head * mb, head_copies, "d2h grad", [last], "d2h"))
            fetch = None
            if not (backward and 2 * (layers - 1 - i) < window - 1):  # else kept since its forward: used again soon
                deps = [computes[v - window] if v >= window else None, None if backward else after]
                if window == 1:  # on demand: issued when the block is next, after whatever computed last (the head)
                    deps.append(last)
                # NVMe into a pinned bounce buffer, then over the link
                if self.config.placement.params_on == "nvme":
                    deps = [plan.add("nvme_read", f"read block {i}", hw.nvme_read_overhead + block * mb / hw.nvme_read,
                                     deps, block * mb, stream="param read", host_bytes=block * mb)]
                fetch = self.copy("h2d", block * mb, block_tensors, f"fetch block {i}", deps, "param h2d")
            seconds = self.forward_s * block / work.num_params
            if backward:  # the host issues each gradient copy from its hook
                seconds = (self.backward_s * block / work.num_params
                           + self.hooks(block_tensors, block_copies, block_gathered))
            if fetch is not None:  # the streamer's hooks fetch it (and release the one before) on the same thread
                seconds += hw.fetch_overhead
            last = plan.add("compute", f"{'backward' if backward else 'forward'} block {i}", seconds, [last, fetch],
                            stream="compute")
            computes.append(last)
            if backward:
                copies.append(self.copy("d2h", block * mb, block_copies, "d2h grad", [last], "d2h"))
        return last, copies

    def cpu_groups(self) -> set[int]:
        options = self.config.options
        resident, streamed = device_subgroups(len(self.groups), options.gpu_fraction, options.stride)
        return set(range(len(self.groups))) - set(resident) - set(streamed)

    def step(self, after: int | None) -> int:
        """One step after `after` (the previous step's end); returns the op at which the next forward may start."""
        config, work, plan, hw, groups = self.config, self.work, self.plan, self.hw, self.groups
        if config.placement.streamed:
            backward, streamed_copies = self.streamed_forward_backward(after)
            grad_copies = {0: streamed_copies}
        else:
            backward, grad_copies = self.forward_backward(after)
        if not config.placement.offloaded:
            return plan.add("compute", "device adam", work.num_params / hw.device_adam_rate,
                            [backward, *grad_copies.get(0, [])], stream="compute")
        on_cpu = sorted(self.cpu_groups())
        if config.options.speculative:
            return self.speculative_update(backward, grad_copies[0], on_cpu)
        own = {rank: [i for i in on_cpu if self.owners[i] == rank] for rank in range(self.ranks)}
        ready, uploads = {}, {rank: [] for rank in range(self.ranks)}
        for rank, mine in own.items():  # step() on each rank: its own subgroups' gradients are in
            entry = plan.mark([backward, *grad_copies.get(rank, [])])  # waits for every gradient copy
            self.entry[rank] = entry
            if config.options.delayed and rank in self.job:  # send the last update's weights first
                entry = plan.mark([entry, self.job[rank]])
                uploads[rank].append(self.copy("h2d", sum(groups[i][0] for i in mine) * work.model_bytes,
                                               len(mine), "h2d weights", [entry], "h2d", rank))  # one per subgroup
            if config.placement.grads_on == "nvme":  # each subgroup summed and written out as backward goes on
                ready[rank] = plan.mark([entry, *self.grads_to_drive(mine, entry)])
                continue
            ready[rank] = self.host("accumulate grads", ACCUMULATE_BYTES + work.model_bytes,
                                    sum(groups[i][0] for i in mine), [entry], rank=rank)
        if config.options.clips:
            self.clip(own, ready)
        device_done = self.device_path(groups, ready[0], backward)
        last_cpu = {rank: self.update(rank, own[rank], ready[rank], uploads[rank]) for rank in own}
        broadcasts = []
        if self.ranks > 1:  # each subgroup's new weights from its owner to every rank, in subgroup order
            for i in on_cpu:
                done = uploads[self.owners[i]][own[self.owners[i]].index(i)]
                broadcasts.append(self.collective("broadcast", groups[i][0] * work.model_bytes, "broadcast weights",
                                                  [done]))
        every_upload = [op for ops in uploads.values() for op in ops]
        if config.options.delayed:
            self.job = last_cpu  # runs on beside the next forward and backward
            return plan.mark([*ready.values(), *every_upload, *broadcasts])
        return plan.mark([*last_cpu.values(), *every_upload, *broadcasts, device_done])

    def speculative_update(self, backward: int, grad_copies: list[int], on_cpu: list[int]) -> int:
        """Each subgroup's update on a worker as soon as its gradients are on the host, in the order they arrive (the
        last subgroup first); after backward only the validation: the global norm combined from the sums of squares
        taken as the gradients were added in (clipping). Nothing is redone: the common case."""
        self.entry[0] = self.plan.mark([backward, *grad_copies])
        order, uploads = on_cpu[::-1], []
        last_cpu = self.update(0, order, self.arrived[order[0]], uploads)
        validate = self.host("validate norm", 0, 0, [self.entry[0]]) if self.config.options.clips else None
        return self.plan.mark([last_cpu, *uploads, validate])

    def clip(self, own: dict[int, list[int]], ready: dict[int, int]) -> None:
        """The global norm's passes on each rank's own subgroups; with ranks > 1 the partial norms are all-reduced
        (a few bytes: the collective's fixed cost) between the norm's read and the scaling."""
        params = {rank: sum(self.groups[i][0] for i in mine) for rank, mine in own.items()}
        if self.ranks == 1:
            ready[0] = self.host("clip", CLIP_BYTES, params[0], [ready[0]])
            return
        norms = [self.host("clip norm", 4, params[rank], [ready[rank]], rank=rank) for rank in own]
        total = self.plan.add("net", "all-reduce norm", self.hw.collective_latency, norms, stream="net")
        for rank in own:
            ready[rank] = self.host("clip scale", CLIP_BYTES - 4, params[rank], [total], rank=rank)

    def update(self, rank: int, mine: list[int], ready: int, uploads: list[int]) -> int:
        """Rank `rank`'s CPU update of its own subgroups `mine`, in that order (its NVMe reads and writes, its uploads
        appended to `uploads`); returns its last CPU op. Speculative: each subgroup also waits for its own gradients
        and adds them in first."""
        config, plan, hw, groups, mb = self.config, self.plan, self.hw, self.groups, self.work.model_bytes
        # these run on a thread of their own
        stream = "update" if config.options.delayed or config.options.speculative else "host"
        reads = self.nvme_reads(mine, ready, rank) if config.placement.optimizer_on == "nvme" else {}
        last_cpu, writes = ready, []
        for k, i in enumerate(mine):
            params, _ = groups[i]
            # prefetch the next subgroup into the third working set
            if config.placement.optimizer_on == "nvme" and k + 1 < len(mine):
                reads[mine[k + 1]] = self.nvme_read(groups[mine[k + 1]][0], [
                    last_cpu, writes[k - 2] if k >= 2 else None, uploads[k - 2] if k >= 2 else None], rank)
            # its gradients, added in as they arrive (with the norm's read when clipping)
            if config.options.speculative:
                last_cpu = self.host("accumulate grads", ACCUMULATE_BYTES + mb + 4 * config.options.clips, params,
                                     [last_cpu, self.arrived[i]], stream)
            last_cpu = plan.add(_on("cpu", rank), f"adam {params / 1e6:.2f}M",
                                hw.subgroup_overhead + params / hw.cpu_adam_rate,
                                [last_cpu, reads.get(i)], stream=_on(stream, rank),
                                host_bytes=params * ADAM_BYTES_PER_PARAM)
            rounding = (4 + mb) if mb != 4 else 0  # fp32 master -> 16-bit staging, for the upload
            last_cpu = self.host("round + zero grad", rounding + ZERO_BYTES, params, [last_cpu], stream,
                                 issue=0 if config.options.delayed or config.placement.streamed else 1, rank=rank)
            if config.placement.optimizer_on == "nvme":
                state = params * STATE_BYTES_PER_PARAM
                writes.append(plan.add(_on("nvme_write", rank), "nvme write",
                                       hw.nvme_write_overhead + state / hw.nvme_write, [last_cpu], state,
                                       stream=_on("nvme_write", rank), host_bytes=state))
            if config.placement.params_on == "nvme":  # the rounded weights go home to NVMe, not up the link
                uploads.append(plan.add("nvme_write", "nvme write weights",
                                        hw.nvme_write_overhead + params * mb / hw.nvme_write, [last_cpu],
                                        params * mb, stream="param write", host_bytes=params * mb))
            elif config.placement.params_on == "host":
                uploads.append(last_cpu)  # rounded into the host home: the next fetch reads it there
            elif not config.options.delayed:
                uploads.append(self.copy("h2d", params * mb, 1, "h2d weights", [last_cpu], "h2d", rank))
        return last_cpu

    def grads_to_drive(self, mine: list[int], entry: int) -> list[int]:
        """Gradients on NVMe (engine/grad_spill.py): each subgroup, once its gradients have arrived (in backward's
        order), is summed on the host and its fp32 gradient written to the drive; the update reads it back."""
        writes, last = [], None
        for i in sorted(mine, reverse=True):
            params = self.groups[i][0]
            last = self.host("accumulate grads", ACCUMULATE_BYTES + self.work.model_bytes, params,
                             [self.arrived.get(i, entry), last])
            writes.append(self.plan.add("nvme_write", "nvme write grad", self.hw.nvme_write_overhead
                                        + 4 * params / self.hw.nvme_write, [last], 4 * params, stream="nvme_write",
                                        host_bytes=4 * params))
        return writes

    def nvme_read(self, params: int, deps, rank: int = 0) -> int:
        # the state, and with gradients on NVMe the gradient too
        state = params * (STATE_BYTES_PER_PARAM + (4 if self.config.placement.grads_on == "nvme" else 0))
        seconds = self.hw.nvme_read_overhead + state / self.hw.nvme_read
        return self.plan.add(_on("nvme_read", rank), "nvme read", seconds, deps, state, stream=_on("nvme_read", rank),
                             host_bytes=state)

    def nvme_reads(self, mine: list[int], ready: int, rank: int) -> dict[int, int]:
        """The first subgroup's state is read when the update starts (the NVMe tier reads one ahead)."""
        return {mine[0]: self.nvme_read(self.groups[mine[0]][0], [ready], rank)} if mine else {}

    def device_path(self, groups, ready: int, backward: int) -> int | None:
        """Chapter 5's hybrid update: resident subgroups updated in place; streamed ones copied in, updated, copied
        out, over `scratch_sets` scratch sets. As engine/device_path.py queues it: the state of the first streamed
        subgroups whose gradients exist (as many as there are sets) starts in during backward, and those are
        updated first; the others follow in order, each waiting for a set to be free."""
        config, plan, hw = self.config, self.plan, self.hw
        resident, streamed = device_subgroups(len(groups), config.options.gpu_fraction, config.options.stride)
        sets = scratch_sets(max(groups[i][0] for i in streamed), hw.link_h2d, hw.device_adam_rate,
                            hw.link_latency) if streamed else 0
        early = sorted(streamed, reverse=True)[:sets]  # backward makes the last subgroups' gradients first
        order = [*early, *sorted(i for i in [*resident, *streamed] if i not in early)]
        freed, last = [], None
        for i in order:
            params, _ = groups[i]
            deps = [ready, backward]
            if i in streamed:
                state = params * STATE_BYTES_PER_PARAM
                scratch_free = freed[-sets] if len(freed) >= sets else self.state_home
                came = self.grads_made.get(i, backward) if i in early else ready
                deps.append(self.copy("h2d", state, 3, "h2d state", [came, scratch_free], "state h2d"))
            # device_path._adam: gather the gradients into the flat buffer, Adam, write the weights in place
            passes = DEVICE_PATH_BYTES + 2 * self.work.model_bytes
            seconds = params / hw.device_adam_rate + params * passes / hw.device_bandwidth
            last = plan.add("compute", f"device adam {params / 1e6:.2f}M", seconds, deps, stream="device adam",
                            host_bytes=params * (ADAM_BYTES_PER_PARAM + passes) if hw.shared_host else 0)
            if i in streamed:
                freed.append(self.copy("d2h", params * STATE_BYTES_PER_PARAM, 3, "d2h state", [last], "state d2h"))
        self.state_home = freed[-1] if freed else None  # the next step's state waits for this one to be home
        return last  # the next forward waits for the weights the device wrote, not for the state's way home


def predict(work: Workload, hw: Hardware, config: StepConfig | None = None, steps: int = 3) -> Prediction:
    """The predicted steady-state step of `work` on `hw` with `config` (default: optimizer offload)."""
    # A prediction makes tens of thousands of small objects (ops, their deps, spans) that live until it returns:
    # the garbage collector's full passes over them took a third of a planner's search, and find nothing to free.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _predict(work, hw, config, steps)
    finally:
        if enabled:
            gc.enable()


def _predict(work: Workload, hw: Hardware, config: StepConfig | None, steps: int) -> Prediction:
    config = config or StepConfig()
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a profiles.Hardware (profiles.preset(name) or profiles.probe()), got "
                        f"{type(hw).__name__}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the last one is reported in steady state), got {steps}")
    builder, ranks = _Builder(work, hw, config), config.placement.ranks
    ends, after, first_op_of_last_step = [], None, 0
    for _ in range(steps):
        first_op_of_last_step = len(builder.plan.ops)
        after = builder.step(after)
        ends.append(after)
    schedule(builder.plan, lambda lane: resource_of(lane, hw))
    ops = builder.plan.ops
    start, end = ops[ends[-2]].end, ops[ends[-1]].end
    trace = Trace(origin=0.0)
    # the last step's window: what runs between the previous step's end and this one's
    trace.record_many((op.lane, op.name, max(op.start, start) - start, min(op.end, end) - start, op.nbytes)
                      for op in ops if op.lane and rank_of(op.lane) in (0, None) and op.end > start
                      and op.start < end and op.seconds > 0)
    # Host DRAM is one resource the lanes share: the CPU's passes and every DMA to or from host memory. The
    # schedule lets them overlap freely; the step can be no shorter than their bytes over its bandwidth, and a
    # synchronous update phase (from step() to the next forward) no shorter than its own bytes over it.
    # Each rank has its own share of host DRAM; on a shared host (the sim) every rank uses the one.
    last_step = ops[first_op_of_last_step:]
    prediction = _prediction(trace, end - start, hw)
    links = [sum(op.nbytes for op in last_step if op.lane in (_on("d2h", r), _on("h2d", r))) for r in range(ranks)]
    prediction.ranks, prediction.link_bytes, prediction.rank_link_bytes = ranks, links[0], tuple(links)
    prediction.interconnect_bytes = sum(op.nbytes for op in last_step if op.lane == "net")

    def host_bytes(rank: int, after: float = -math.inf) -> float:  # rank-less lanes (compute, net) count for all
        return sum(op.host_bytes for op in last_step if op.start >= after and (
            hw.shared_host or (rank_of(op.lane) or 0) == rank))

    prediction.host_memory_s = max(host_bytes(rank) for rank in range(ranks)) / hw.host_bandwidth
    prediction.lower_bound_s = max([*prediction.resource_busy.values(), prediction.host_memory_s])
    floor = prediction.host_memory_s
    # the update phase: from a rank's step() to the next forward
    if config.placement.offloaded and not config.options.delayed:
        entries = {0: min(builder.entry.values(), key=lambda op: ops[op].end)} if hw.shared_host else builder.entry
        for rank, op in entries.items():
            entry = ops[op].end
            floor = max(floor, entry - start + host_bytes(rank, entry) / hw.host_bandwidth)
    if floor > prediction.step_s:
        prediction.step_s, prediction.bound = floor, "host memory"
    return prediction
