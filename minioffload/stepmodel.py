"""A model of one training step: predict its timeline, its length, the resource that bounds it, and what is exposed.

    work = Workload(num_params=7e9, tokens=8 * 4096, num_tensors=291)
    pred = predict(work, profiles.preset("h100-sxm"), StepConfig(delay=True))
    pred.step_s, pred.bound, pred.exposed      # seconds; "cpu"; {"cpu": 2.1, "h2d": 0.0, ...}
    course.viz.timeline(pred.trace)             # the same lanes a measured run records

The step is built as the runtime runs it: a list of operations, each on a lane ("compute", "d2h", "h2d",
"cpu", "nvme_read", "nvme_write"), with a duration from the hardware profile and the operations it waits
for. A list scheduler (schedule.py) places each operation at the earliest time its inputs are ready and its resource is
free. Durations, per operation:

    forward  2 N T / (peak x mfu)          backward  4 N T / (peak x mfu)  (+ 2 N T for a recomputed forward)
    a copy   latency + bytes / link        CPU Adam  n / cpu_adam_rate   other host passes  bytes / host_bandwidth
    disk     bytes / nvme_read or write    device Adam  n / device_adam_rate

Which resources are one: each lane is its own resource, except that reads and writes share one drive, and
on a `shared_host` profile (the simulated device) the device's compute and the CPU's work run on the same
cores, so they queue behind each other instead of overlapping. Host DRAM is shared by the CPU's passes and by
every DMA to or from host memory (link copies, disk reads and writes): the step is no shorter than all those
bytes over `host_bandwidth` (the "host memory" bound, which the chapter 5 paper observes as PCIe transfers
contending with the CPU update). Several steps are simulated and the last one is reported, so a delayed update
that spills into the next step is counted as it would be in a long run.

Streamed parameters (chapter 8, `params_on="host"` or `"nvme"`): the blocks' weights live off the device. Forward
and backward run block by block (backward in reverse); each block's compute waits for its fetch (an H2D copy, after
an NVMe read with the "nvme" home), and the fetch of the v-th block visited may not start before the (v - k - 1)-th
has finished computing (k = `prefetch`: at most k + 1 blocks on the device); a block whose backward comes within k
uses of its forward is kept, not fetched again (streaming.py's rule). Weights outside the blocks stay
resident and their FLOPs are counted at the LM head, between forward and backward. After the update nothing is
uploaded: the CPU rounds the master into the host home (no pass for fp32: the master is the home) or writes the
rounded weights to NVMe. `Prediction.exposed_fetch_s` is the fetch time not hidden under compute. Not modelled:
the runtime's prefetches of the next step's first blocks during the last backward, which its optimizer step drops.

What this is not: a simulator of kernels or of an allocator. It knows the runtime's configurations
(on-device, optimizer offload, delayed update, hybrid split, NVMe tier, streamed parameters) and the byte counts
each moves; it ignores Python overheads, caches, and everything the profile does not name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import STATE_BYTES_PER_PARAM, device_subgroups
from .memory import PRECISIONS
from .options import OffloadOptions
from .profiles import ADAM_BYTES_PER_PARAM, Hardware
from .schedule import Plan, schedule
from .trace import Trace, union_length

# Bytes per parameter of the host passes the engine makes besides Adam (offload.py):
ACCUMULATE_BYTES = 8  # grad (fp32) += staging: read 4 + write 4, plus the staging's own bytes (model dtype)
CLIP_BYTES = 12  # global norm: one read (gradnorm.sum_of_squares, 4); then grad *= coef (4 + 4)
ZERO_BYTES = 4  # grad.zero_() after the update
DEVICE_PATH_BYTES = 8  # hybrid device path besides Adam: gather the gradients into fp32 (write 4) and read the
#                       master to write the weights (read 4); plus the gradient read and the weight write, each in
#                       the model's dtype
PARAMS_ON = ("device", "host", "nvme")  # where the blocks' weights live (StepConfig.params_on)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains: `num_params` over `tokens` tokens (batch x sequence x accumulation),
    in `precision`; `num_tensors` parameter tensors (each is one copy each way, and pays a copy's latency)."""

    num_params: int
    tokens: int
    precision: str = "mixed_bf16"
    num_tensors: int = 1
    recompute: bool = False  # full activation checkpointing: one more forward during backward
    num_layers: int = 1  # transformer blocks, of equal size: streamed parameters travel block by block
    resident_params: int = 0  # parameters outside the blocks (embeddings, tied head, final norm): never streamed

    def __post_init__(self) -> None:
        for name in ("num_params", "tokens", "num_tensors", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not value >= 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if isinstance(self.resident_params, bool) or not 0 <= self.resident_params < self.num_params:
            raise ValueError(f"resident_params must be in [0, num_params) (the blocks hold the rest), got "
                             f"{self.resident_params!r} of {self.num_params}")

    @property
    def block_params(self) -> float:
        """Parameters of one block."""
        return (self.num_params - self.resident_params) / self.num_layers

    @property
    def model_bytes(self) -> int:
        """Bytes per value of the weights and gradients the device computes with."""
        return 4 if self.precision == "fp32" else 2

    @classmethod
    def of(cls, model, tokens: int, precision: str | None = None, recompute: bool = False) -> Workload:
        """The workload of a torch model: its trainable parameters and tensors, its dtype unless given; its blocks
        from `model.blocks` when it has them (a course GPT), else one block of everything."""
        params = [p for p in model.parameters() if p.requires_grad]
        if precision is None:
            precision = "fp32" if params[0].dtype.itemsize == 4 else "mixed_bf16"
        num_params, blocks = sum(p.numel() for p in params), getattr(model, "blocks", None)
        if not blocks:
            return cls(num_params, tokens, precision, len(params), recompute)
        in_blocks = sum(p.numel() for p in blocks.parameters() if p.requires_grad)
        return cls(num_params, tokens, precision, len(params), recompute, len(blocks), num_params - in_blocks)


@dataclass(frozen=True)
class StepConfig:
    """The runtime configuration to predict. `offload=False`: everything on the device (torch's AdamW there).
    Otherwise OffloadAdam with the options of the same names; `nvme`: its NVMe tier; `clip`: max_grad_norm set."""

    offload: bool = True
    subgroup_numel: int = 1 << 22
    delay: bool = False
    gpu_fraction: float | None = None
    stride: int | None = None
    nvme: bool = False
    clip: bool = False
    mfu: float = 0.4  # model FLOP/s utilisation of forward and backward
    params_on: str = "device"  # the blocks' weights: resident ("device"), or streamed from "host" or "nvme"
    prefetch: int = 1  # streamed: blocks fetched ahead of the one computing (0: on demand)

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.params_on not in PARAMS_ON:
            raise ValueError(f"params_on must be one of {', '.join(map(repr, PARAMS_ON))}, got {self.params_on!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (blocks fetched ahead; 0 fetches on demand), got "
                             f"{self.prefetch!r}")
        options = self.options  # the engine's rules, with its messages (options.py)
        if not self.offload and (options.offload_only() or self.nvme):
            raise ValueError("delay, gpu_fraction/stride and nvme are options of the offloaded optimizer; "
                             "set offload=True or drop them")
        if self.streamed and not self.offload:
            raise ValueError(f"params_on={self.params_on!r} streams weights that the CPU optimizer updates; set "
                             "offload=True or params_on='device'")
        if self.streamed and (self.delay or self.gpu_fraction is not None or self.stride is not None):
            raise ValueError(f"params_on={self.params_on!r} is modelled with the synchronous CPU update only; drop "
                             "delay, gpu_fraction and stride, or set params_on='device'")
        if self.nvme:
            options.check_nvme()

    @property
    def streamed(self) -> bool:
        return self.params_on != "device"

    @property
    def options(self) -> OffloadOptions:
        """The engine's options this configuration predicts."""
        return OffloadOptions(subgroup_numel=self.subgroup_numel, max_grad_norm=1.0 if self.clip else None,
                              delay_updates_after=0 if self.delay else None, gpu_fraction=self.gpu_fraction,
                              stride=self.stride)

    @classmethod
    def of(cls, options: OffloadOptions, offload: bool = True, nvme: bool = False, mfu: float = 0.4,
           params_on: str = "device", prefetch: int = 1) -> StepConfig:
        """The configuration of an engine built with `options` (its delayed update counted from the start)."""
        return cls(offload, options.subgroup_numel, options.delayed, options.gpu_fraction, options.stride, nvme,
                   options.max_grad_norm is not None, mfu, params_on, prefetch)


def resource_of(lane: str, hw: Hardware) -> str:
    """The resource a lane's work occupies on `hw` (lanes that share one are added up, not overlapped)."""
    if lane in ("nvme_read", "nvme_write"):
        return "nvme"  # one drive: reads and writes share it
    if hw.shared_host and lane in ("compute", "cpu"):
        return "host"
    return lane


def _subgroups(work: Workload, numel: int) -> list[tuple[int, int]]:
    """(params, tensors) per subgroup: parameters packed in order into subgroups of about `numel`, tensors of
    equal size (the model knows counts, not shapes)."""
    per_tensor = work.num_params / work.num_tensors
    per_group = max(1, min(work.num_tensors, int(numel // per_tensor) or 1))
    out, left = [], work.num_tensors
    while left > 0:
        tensors = min(per_group, left)
        out.append((round(tensors * per_tensor), tensors))
        left -= tensors
    return out


class _Builder:
    """The operations of one step of each configuration, in the runtime's order."""

    def __init__(self, work: Workload, hw: Hardware, config: StepConfig):
        self.work, self.hw, self.config, self.plan = work, hw, config, Plan()
        flops = hw.peak_flops(work.precision) * config.mfu
        n, t = work.num_params, work.tokens
        self.forward_s = 2 * n * t / flops
        self.backward_s = (4 + 2 * work.recompute) * n * t / flops
        self.job = None  # delayed update: the background update's last op
        self.entry = None  # the last step()'s start: every gradient has arrived
        self.state_home = None  # hybrid: the last streamed state copied back to the host

    def copy(self, direction: str, nbytes: float, copies: int, name: str, deps, stream: str) -> int:
        link = self.hw.link_h2d if direction == "h2d" else self.hw.link_d2h
        # DMA touches host memory once; on a shared host (the sim) a "copy" is a memcpy that reads and writes it
        return self.plan.add(direction, name, copies * self.hw.link_latency + nbytes / link, deps, nbytes, stream,
                             host_bytes=nbytes * (2 if self.hw.shared_host else 1))

    def host(self, name: str, bytes_per_param: float, params: float, deps, stream: str = "host", issue: int = 0) -> int:
        """A pass over host memory, plus the host time to issue `issue` copies after it."""
        seconds = params * bytes_per_param / self.hw.host_bandwidth + issue * self.hw.copy_overhead
        return self.plan.add("cpu", name, seconds, deps, stream=stream, host_bytes=params * bytes_per_param)

    def forward_backward(self, after: int | None) -> tuple[int, list[int]]:
        """Forward, then backward in pieces with each piece's gradient copy (offloaded CPU subgroups only)."""
        plan, work, mb = self.plan, self.work, self.work.model_bytes
        forward = plan.add("compute", "forward", self.forward_s, [after], stream="compute")
        if not self.config.offload:
            return plan.add("compute", "backward", self.backward_s, [forward], stream="compute"), []
        groups = _subgroups(work, self.config.subgroup_numel)
        on_cpu = self.cpu_groups(groups)
        copies, last = [], forward
        for index in reversed(range(len(groups))):  # backward produces the last layers' gradients first
            params, tensors = groups[index]
            hooks = tensors * self.hw.copy_overhead if index in on_cpu else 0.0  # the host issues each copy
            last = plan.add("compute", "backward", self.backward_s * params / work.num_params + hooks, [last],
                            stream="compute")
            if index in on_cpu:
                copies.append(self.copy("d2h", params * mb, tensors, "d2h grad", [last], "d2h"))
        return last, copies

    def streamed_forward_backward(self, after: int | None) -> tuple[int, list[int]]:
        """Block by block: forward 0..L-1, the resident head, backward L-1..0; each block fetched before it runs
        (within the window of prefetch + 1 blocks) and its gradient copied out after its backward. As the runtime
        does, a block whose backward is among the next `prefetch` uses after its forward stays (the last
        (prefetch + 1) // 2 blocks turn into the backward without a second fetch)."""
        plan, work, hw, mb = self.plan, self.work, self.hw, self.work.model_bytes
        layers, window = work.num_layers, self.config.prefetch + 1
        block, head = work.block_params, work.resident_params
        block_tensors = max(1, round(work.num_tensors * block / work.num_params))
        head_tensors = max(1, work.num_tensors - layers * block_tensors)
        visits = [*((False, i) for i in range(layers)), *((True, i) for i in reversed(range(layers)))]
        computes, copies, last = [], [], after
        for v, (backward, i) in enumerate(visits):
            if backward and i == layers - 1:  # the head, between forward and backward, with the weights it keeps
                last = plan.add("compute", "forward head", self.forward_s * head / work.num_params, [last],
                                stream="compute")
                last = plan.add("compute", "backward head", self.backward_s * head / work.num_params
                                + head_tensors * hw.copy_overhead * bool(head), [last], stream="compute")
                if head:
                    copies.append(self.copy("d2h", head * mb, head_tensors, "d2h grad", [last], "d2h"))
            fetch = None
            if not (backward and 2 * (layers - 1 - i) < window - 1):  # else kept since its forward: used again soon
                deps = [computes[v - window] if v >= window else None, None if backward else after]
                if window == 1:  # on demand: issued when the block is next, after whatever computed last (the head)
                    deps.append(last)
                if self.config.params_on == "nvme":  # NVMe into a pinned bounce buffer, then over the link
                    deps = [plan.add("nvme_read", f"read block {i}", block * mb / hw.nvme_read, deps, block * mb,
                                     stream="param read", host_bytes=block * mb)]
                fetch = self.copy("h2d", block * mb, block_tensors, f"fetch block {i}", deps, "param h2d")
            seconds = self.forward_s * block / work.num_params
            if backward:  # the host issues each gradient copy from its hook
                seconds = self.backward_s * block / work.num_params + block_tensors * hw.copy_overhead
            last = plan.add("compute", f"{'backward' if backward else 'forward'} block {i}", seconds, [last, fetch],
                            stream="compute")
            computes.append(last)
            if backward:
                copies.append(self.copy("d2h", block * mb, block_tensors, "d2h grad", [last], "d2h"))
        return last, copies

    def cpu_groups(self, groups) -> set[int]:
        resident, streamed = device_subgroups(len(groups), self.config.gpu_fraction, self.config.stride)
        return set(range(len(groups))) - set(resident) - set(streamed)

    def step(self, after: int | None) -> int:
        """One step after `after` (the previous step's end); returns the op at which the next forward may start."""
        config, work, plan, hw, mb = self.config, self.work, self.plan, self.hw, self.work.model_bytes
        backward, grad_copies = (self.streamed_forward_backward if config.streamed else self.forward_backward)(after)
        if not config.offload:
            return plan.add("compute", "device adam", work.num_params / hw.device_adam_rate, [backward],
                            stream="compute")
        groups = _subgroups(work, config.subgroup_numel)
        on_cpu = sorted(self.cpu_groups(groups))
        cpu_params = sum(groups[i][0] for i in on_cpu)
        entry = plan.mark([backward, *grad_copies])  # step(): waits for every gradient copy
        self.entry = entry
        uploads = []
        if config.delay and self.job is not None:  # send the last update's weights first
            entry = plan.mark([entry, self.job])
            tensors = sum(groups[i][1] for i in on_cpu)
            uploads.append(self.copy("h2d", cpu_params * mb, tensors, "h2d weights", [entry], "h2d"))
        ready = self.host("accumulate grads", ACCUMULATE_BYTES + mb, cpu_params, [entry])
        if config.clip:
            ready = self.host("clip", CLIP_BYTES, cpu_params, [ready])
        device_done = self.device_path(groups, ready, backward)
        stream = "update" if config.delay else "host"  # the delayed update runs on a thread of its own
        reads = self.nvme_reads(groups, on_cpu, ready) if config.nvme else {}
        last_cpu, writes = ready, []
        for k, i in enumerate(on_cpu):
            params, tensors = groups[i]
            if config.nvme and k + 1 < len(on_cpu):  # prefetch the next subgroup into the third working set
                reads[on_cpu[k + 1]] = self.nvme_read(groups[on_cpu[k + 1]][0], [
                    last_cpu, writes[k - 2] if k >= 2 else None, uploads[k - 2] if k >= 2 else None])
            last_cpu = plan.add("cpu", f"adam {params / 1e6:.2f}M", params / hw.cpu_adam_rate,
                                [last_cpu, reads.get(i)], stream=stream, host_bytes=params * ADAM_BYTES_PER_PARAM)
            rounding = (4 + mb) if mb != 4 else 0  # fp32 master -> 16-bit staging, for the upload
            last_cpu = self.host("round + zero grad", rounding + ZERO_BYTES, params, [last_cpu], stream,
                                 issue=0 if config.delay or config.streamed else tensors)
            if config.nvme:
                state = params * STATE_BYTES_PER_PARAM
                writes.append(plan.add("nvme_write", "nvme write", state / hw.nvme_write, [last_cpu], state,
                                       stream="nvme_write", host_bytes=state))
            if config.params_on == "nvme":  # the rounded weights go home to NVMe, not up the link
                uploads.append(plan.add("nvme_write", "nvme write weights", params * mb / hw.nvme_write, [last_cpu],
                                        params * mb, stream="param write", host_bytes=params * mb))
            elif config.params_on == "host":
                uploads.append(last_cpu)  # rounded into the host home: the next fetch reads it there
            elif not config.delay:
                uploads.append(self.copy("h2d", params * mb, tensors, "h2d weights", [last_cpu], "h2d"))
        if config.delay:
            self.job = last_cpu  # runs on beside the next forward and backward
            return plan.mark([ready, *uploads])
        return plan.mark([last_cpu, *uploads, device_done])

    def nvme_read(self, params: int, deps) -> int:
        state = params * STATE_BYTES_PER_PARAM
        return self.plan.add("nvme_read", "nvme read", state / self.hw.nvme_read, deps, state, stream="nvme_read",
                             host_bytes=state)

    def nvme_reads(self, groups, on_cpu: list[int], ready: int) -> dict[int, int]:
        """The first subgroup's state is read when the update starts (the NVMe tier reads one ahead)."""
        return {on_cpu[0]: self.nvme_read(groups[on_cpu[0]][0], [ready])} if on_cpu else {}

    def device_path(self, groups, ready: int, backward: int) -> int | None:
        """Chapter 5's hybrid update: resident subgroups updated in place; streamed ones copied in, updated,
        copied out, over two scratch sets."""
        config, plan, hw = self.config, self.plan, self.hw
        resident, streamed = device_subgroups(len(groups), config.gpu_fraction, config.stride)
        freed, last = [], None
        for i in sorted([*resident, *streamed]):
            params, _ = groups[i]
            deps = [ready, backward]
            if i in streamed:
                state = params * STATE_BYTES_PER_PARAM
                scratch_free = freed[-2] if len(freed) >= 2 else self.state_home  # two scratch sets
                deps.append(self.copy("h2d", state, 3, "h2d state", [ready, scratch_free], "state h2d"))
            # device_path._adam: gather the gradients into the flat buffer, Adam, write the weights in place
            passes = DEVICE_PATH_BYTES + 2 * self.work.model_bytes
            seconds = params / hw.device_adam_rate + params * passes / hw.device_bandwidth
            last = plan.add("compute", f"device adam {params / 1e6:.2f}M", seconds, deps, stream="device adam",
                            host_bytes=params * (ADAM_BYTES_PER_PARAM + passes) if hw.shared_host else 0)
            if i in streamed:
                freed.append(self.copy("d2h", params * STATE_BYTES_PER_PARAM, 3, "d2h state", [last], "state d2h"))
        self.state_home = freed[-1] if freed else None  # the next step's state waits for this one to be home
        return last  # the next forward waits for the weights the device wrote, not for the state's way home


@dataclass
class Prediction:
    """A predicted step: its length, its trace (the last of the simulated steps, starting at 0), busy time per
    lane, the resource with the most busy time (`bound`: a lane, "nvme" for the drive, "host" for the shared
    cores of the sim, "host memory" when the step's DRAM traffic sets its length), and per lane the busy time
    not hidden behind compute (`exposed`)."""

    step_s: float
    trace: Trace
    busy: dict[str, float]
    exposed: dict[str, float]
    bound: str
    host_memory_s: float = 0.0  # the step's host DRAM traffic over host_bandwidth: a floor on step_s
    # (when a floor sets step_s, bound is "host memory" and the trace shows the schedule it stretched)
    fetch_s: float = 0.0  # streamed parameters: time some block's weights were on their way (NVMe read or H2D)
    exposed_fetch_s: float = 0.0  # ... of which no compute ran at the same time

    @property
    def exposed_fetch_fraction(self) -> float:
        """Exposed fetch time over fetch time (0 when nothing is fetched)."""
        return self.exposed_fetch_s / self.fetch_s if self.fetch_s else 0.0

    def summary(self) -> str:
        busy = ", ".join(f"{lane} {seconds * 1e3:.1f}" for lane, seconds in self.busy.items())
        return f"step {self.step_s * 1e3:.1f} ms, bound by {self.bound} (busy ms: {busy})"


def predict(work: Workload, hw: Hardware, config: StepConfig | None = None, steps: int = 3) -> Prediction:
    """The predicted steady-state step of `work` on `hw` with `config` (default: optimizer offload)."""
    config = config or StepConfig()
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a profiles.Hardware (profiles.preset(name) or profiles.probe()), got "
                        f"{type(hw).__name__}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the last one is reported in steady state), got {steps}")
    builder = _Builder(work, hw, config)
    ends, after, first_op_of_last_step = [], None, 0
    for _ in range(steps):
        first_op_of_last_step = len(builder.plan.ops)
        after = builder.step(after)
        ends.append(after)
    schedule(builder.plan, lambda lane: resource_of(lane, hw))
    ops = builder.plan.ops
    start, end = ops[ends[-2]].end, ops[ends[-1]].end
    trace = Trace(origin=0.0)
    for op in ops:  # the last step's window: what runs between the previous step's end and this one's
        if op.lane and op.end > start and op.start < end and op.seconds > 0:
            trace.record(op.lane, op.name, max(op.start, start) - start, min(op.end, end) - start, op.nbytes)
    # Host DRAM is one resource the lanes share: the CPU's passes and every DMA to or from host memory. The
    # schedule lets them overlap freely; the step can be no shorter than their bytes over its bandwidth, and a
    # synchronous update phase (from step() to the next forward) no shorter than its own bytes over it.
    last_step = ops[first_op_of_last_step:]
    prediction = _prediction(trace, end - start, hw)
    prediction.host_memory_s = sum(op.host_bytes for op in last_step) / hw.host_bandwidth
    floor = prediction.host_memory_s
    if config.offload and not config.delay:
        entry = ops[builder.entry].end
        phase_bytes = sum(op.host_bytes for op in last_step if op.start >= entry)
        floor = max(floor, entry - start + phase_bytes / hw.host_bandwidth)
    if floor > prediction.step_s:
        prediction.step_s, prediction.bound = floor, "host memory"
    return prediction


def _prediction(trace: Trace, step_s: float, hw: Hardware) -> Prediction:
    lanes = sorted({s.lane for s in trace.spans}, key=lambda lane: (lane != "compute", lane))
    busy = {lane: trace.busy(lane) for lane in lanes}
    compute = [(s.start, s.end) for s in trace.spans if s.lane == "compute"]
    fetches = [(s.start, s.end) for s in trace.spans if s.name.startswith(("fetch block", "read block"))]
    exposed = {}
    for lane in lanes:
        if lane != "compute":
            spans = [(s.start, s.end) for s in trace.spans if s.lane == lane]
            exposed[lane] = union_length(spans) - _overlap(spans, compute)
    resources: dict[str, list] = {}
    for span in trace.spans:
        resources.setdefault(resource_of(span.lane, hw), []).append((span.start, span.end))
    bound = max(resources, key=lambda r: union_length(resources[r])) if resources else "nothing"
    fetch_s = union_length(fetches)
    return Prediction(step_s, trace, busy, exposed, bound, fetch_s=fetch_s,
                      exposed_fetch_s=fetch_s - _overlap(fetches, compute))


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
