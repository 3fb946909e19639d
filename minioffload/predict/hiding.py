"""When does it hide? The closed-form conditions the step model implies, one per mechanism, each as the threshold of
one knob at which the work to hide takes exactly as long as the compute it runs under.

    streamed weights     a block's fetch, copies x link_latency + bytes / link_h2d (and bytes / nvme_read, pipelined,
                         from an NVMe home), under the block's forward, 2 P T / (peak x mfu), P its parameters:
                             tokens >= fetch x peak x mfu / (2 P)
    gradient copies      N x model_bytes / link_d2h (+ a latency per tensor) under the backward, 4 N T / (peak x mfu),
                         lengthened by the hooks that issue the copies (copies x (grad_hook_overhead + copy_overhead)
                         on the backward's thread):
                             tokens >= (N x model_bytes / link_d2h + copies x (link_latency - grad_hook_overhead
                                        - copy_overhead)) x peak x mfu / (4 N), and at least 0
    delayed update       the CPU's Adam and its rounding pass over N parameters, run beside the next step's forward
                         and backward, 6 N T / (peak x mfu):
                             tokens >= (1 / cpu_adam_rate + pass bytes / host_bandwidth) x peak x mfu / 6
    activation offload   a block's saved bytes under the next block's forward (activation_cost.offload_hidden_link):
                             link >= saved bytes / forward (the hooks' host time, saved tensors x pack_overhead,
                             runs on the block's own thread: no link hides it)
    NVMe state           the update reads and writes Adam's 12 bytes per parameter (STATE_BYTES_PER_PARAM) on one
                         drive while the CPU updates: the drive keeps up when 12 / nvme_read + 12 / nvme_write <=
                         1 / cpu_adam_rate, i.e. its combined rate 2 / (1 / read + 1 / write) >= 24 x cpu_adam_rate
    checkpoint           a lazy checkpoint (chapter 11) writes the same 12 bytes per parameter beside forward and
                         backward: tokens >= 12 / nvme_write x peak x mfu / 6

Tokens are one micro-batch's (Workload.tokens). Above a threshold the step model puts the work under compute; below,
the difference is exposed in the step.

    hiding.streamed_fetch(work, profiles.preset("h100-sxm")).threshold     # tokens per micro-batch
    hiding.delayed_update(work, hw).hides(work.tokens)                     # True / False

What this is not: a prediction of the step (stepmodel.predict schedules all of it). Each condition is one pair of
lanes in steady state: it leaves out the first block's fetch, the exposed parts that no setting hides (a delayed
update's weight upload, the accumulation pass), each subgroup's fixed cost in the update (subgroup_overhead: 1% of a
7B update on the presets at the default subgroups, 6% on gh200's faster CPU), host DRAM shared between lanes, and the
sim, where copies and the update run on the cores that compute (`shared_host`: nothing hides there, and these
functions refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import STATE_BYTES_PER_PARAM
from ..machine.profiles import Hardware
from .activation_cost import BlockShape, offload_hidden_link
from .step_config import Workload
from .stepmodel import ZERO_BYTES


@dataclass(frozen=True)
class Condition:
    """`work` hides under `under` when the knob (`knob`, in `unit`) is at least `threshold`; `work_s` and `under_s`
    are the two sides' seconds at `at`, the knob's value the condition was asked for."""

    mechanism: str
    work: str
    under: str
    knob: str
    unit: str
    threshold: float
    at: float
    work_s: float
    under_s: float

    def hides(self, value: float | None = None) -> bool:
        """Whether the work hides with the knob at `value` (default: `at`)."""
        return (self.at if value is None else value) >= self.threshold

    def __str__(self) -> str:
        verdict = "hides" if self.hides() else "is exposed"
        return (f"{self.mechanism}: {self.work} ({self.work_s * 1e3:.3g} ms) under {self.under} "
                f"({self.under_s * 1e3:.3g} ms) {verdict}; threshold {self.threshold:.3g} {self.unit}")


def _rate(hw: Hardware, precision: str, mfu: float) -> float:
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a profiles.Hardware, got {type(hw).__name__}")
    if hw.shared_host:
        raise ValueError(f"{hw.name} is a shared host (the sim): copies and the CPU's work run on the cores that "
                         "compute, so nothing hides under compute there; use a GPU preset")
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return hw.peak_flops(precision) * mfu


def streamed_fetch(work: Workload, hw: Hardware, home: str = "host", mfu: float = 0.4) -> Condition:
    """A streamed block's fetch (from the "host" home, or "nvme": the read and the copy pipelined, the slower paces)
    under its forward, with prefetch >= 1 from the host and >= 2 from NVMe (at 0 no fetch overlaps compute; from NVMe
    at 1, a block's read and its copy both wait for the same block's compute and run one after the other, so their
    sum, not the slower, must fit under a forward)."""
    if home not in ("host", "nvme"):
        raise ValueError(f"home must be 'host' or 'nvme', got {home!r}")
    rate = _rate(hw, work.precision, mfu)
    block = work.block_params
    nbytes = block * work.model_bytes
    tensors = max(1, round(work.num_tensors * block / work.num_params))
    fetch = tensors * hw.link_latency + nbytes / hw.link_h2d
    if home == "nvme":
        fetch = max(fetch, nbytes / hw.nvme_read)
    forward = 2 * block * work.tokens / rate
    return Condition("streamed weights", f"a block's fetch from {home}", "its forward", "tokens", "tokens",
                     fetch * rate / (2 * block), work.tokens, fetch, forward)


def gradient_copies(work: Workload, hw: Hardware, mfu: float = 0.4) -> Condition:
    """The gradients' copies to the host (one per tensor) under the backward that makes them, whose thread also runs
    the hooks that issue them."""
    rate = _rate(hw, work.precision, mfu)
    n = work.num_params
    copies = work.num_tensors * hw.link_latency + n * work.model_bytes / hw.link_d2h
    hooks = work.num_tensors * (hw.grad_hook_overhead + hw.copy_overhead)
    backward = 4 * n * work.tokens / rate + hooks
    return Condition("optimizer offload", "the gradients' copies to the host", "the backward", "tokens", "tokens",
                     max(copies - hooks, 0.0) * rate / (4 * n), work.tokens, copies, backward)


def delayed_update(work: Workload, hw: Hardware, mfu: float = 0.4) -> Condition:
    """A delayed update's CPU work (Adam, zeroing the gradients, rounding a 16-bit model's weights) beside the next
    step's forward and backward."""
    rate = _rate(hw, work.precision, mfu)
    n = work.num_params
    passes = ZERO_BYTES + (4 + work.model_bytes if work.model_bytes != 4 else 0)  # stepmodel's "round + zero grad"
    per_param = 1 / hw.cpu_adam_rate + passes / hw.host_bandwidth
    return Condition("optimizer offload", "the delayed CPU update", "the next forward and backward", "tokens",
                     "tokens", per_param * rate / 6, work.tokens, n * per_param, 6 * n * work.tokens / rate)


def activation_offload(block: BlockShape, hw: Hardware, mfu: float = 0.4) -> Condition:
    """A block's saved activations copied to the host under the next block's forward (both directions alike: the
    way back has a backward, twice as long, to hide under)."""
    rate = _rate(hw, "fp32" if block.value_bytes == 4 else "bf16", mfu)
    forward = block.forward_flops() / rate
    return Condition("activation offload", "a block's saved tensors to the host", "the next block's forward",
                     "link_d2h", "B/s", offload_hidden_link(block, hw, mfu), hw.link_d2h,
                     block.saved_bytes() / hw.link_d2h, forward)


def nvme_state(hw: Hardware) -> Condition:
    """The NVMe tier's reads and writes of Adam's state beside the CPU's update of it: the drive's combined rate
    against what the CPU consumes (the knob), per parameter."""
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw must be a profiles.Hardware, got {type(hw).__name__}")
    combined = 2 / (1 / hw.nvme_read + 1 / hw.nvme_write)
    drive = STATE_BYTES_PER_PARAM / hw.nvme_read + STATE_BYTES_PER_PARAM / hw.nvme_write
    return Condition("NVMe state", "reading and writing a parameter's state", "its CPU update", "nvme combined",
                     "B/s", 2 * STATE_BYTES_PER_PARAM * hw.cpu_adam_rate, combined, drive, 1 / hw.cpu_adam_rate)


def checkpoint_write(work: Workload, hw: Hardware, mfu: float = 0.4) -> Condition:
    """A lazy checkpoint's write of the optimizer state (12 bytes per parameter) under one forward and backward."""
    rate = _rate(hw, work.precision, mfu)
    n = work.num_params
    write = n * STATE_BYTES_PER_PARAM / hw.nvme_write
    return Condition("checkpoint", "writing the optimizer state", "one forward and backward", "tokens", "tokens",
                     STATE_BYTES_PER_PARAM / hw.nvme_write * rate / 6, work.tokens, write,
                     6 * n * work.tokens / rate)
