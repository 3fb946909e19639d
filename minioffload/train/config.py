"""`TrainConfig`: every setting of a training run, checked on construction (ValueError naming the field and the fix).

The offload engine's options are one `OffloadOptions` and where the state lives one `Placement`, both checked by the
settings' rules (options.py); this file adds what only a run has (the model preset, the batch, the directories, the
host budget). What this is not: the loop that runs it (train/loop.py) nor the checks that need the disk or the
tokenizer (`loop.preflight`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..model.activations import POLICIES
from ..model.gpt import GPTConfig
from ..options import OffloadOptions, Placement, check_run

DEVICES = ("auto", "sim", "cuda")
PRECISIONS = ("fp32", "bf16")


def _train_defaults() -> OffloadOptions:
    return OffloadOptions(subgroup_numel=1 << 16, max_grad_norm=1.0)  # a small GPT: small subgroups; clipping on


@dataclass
class TrainConfig:
    """Everything a training run needs; checked on construction (ValueError naming the field). The offload
    engine's options are one `OffloadOptions`, and where the state lives (offload, nvme_dir, params_on, prefetch,
    shard) is one `Placement` (`placement`): both checked by the settings' rules (options.py)."""

    device: str = "auto"  # "auto" | "sim" | "cuda"
    model: str = "tiny"  # a GPTConfig preset
    block_size: int = 64  # context length (overrides the preset's)
    batch_size: int = 32  # sequences per micro-batch
    steps: int = 1000  # optimizer steps (the defaults take about a minute on 2 CPU cores with the sim)
    lr: float = 3e-3
    precision: str = "fp32"  # "fp32" | "bf16" (the model's parameters; optimizer state stays fp32)
    offload: bool = True  # True: OffloadAdam (state in pinned host memory); False: torch AdamW on the device
    optimizer: OffloadOptions = field(default_factory=_train_defaults)  # OffloadAdam's options; the baseline
    #                                                                     uses only max_grad_norm
    nvme_dir: str | None = None  # keep the optimizer state in files here (the NVMe tier); None: in host memory
    weights_dir: str | None = None  # params_on="nvme": the weights' files here (another drive, or the optimizer's
    #                                 state in host memory); None: nvme_dir/weights
    activations: str = "keep"  # a policy of model/activations.py for every block, or one per block, comma-separated
    params_on: str = "device"  # where the blocks' weights live: "device", or streamed from "host" or "nvme"
    prefetch: int = 1  # streamed: blocks fetched ahead of the one computing
    grads_on: str = "host"  # where the gradients wait for the update: "host", or "nvme" (with nvme_dir)
    device_memory: int | None = None  # the sim device's memory in bytes (None: its default, 4 GiB)
    host_budget: int | None = None  # bytes of pinned host memory the run may hold (None: no bound); refused before
    #                                 it starts when its count is more, and held to it as it runs
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    shard: bool = False  # shard the optimizer state over torchrun's ranks (chapter 10); needs offload
    checkpoint_dir: str | None = None  # save the run here at its end (torch.distributed.checkpoint)
    checkpoint_every: int | None = None  # with checkpoint_dir: a lazy async checkpoint every N steps instead
    resume: str | None = None  # continue a run saved in this checkpoint directory (either kind)
    out_dir: str | None = None  # None: runs/<timestamp>
    eval_every: int = 100  # steps between validation losses (the last step is always evaluated)
    progress: bool = True  # show a progress bar (when tqdm is installed)

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("model", self.model, tuple(GPTConfig.preset_names()))
        _choice("precision", self.precision, PRECISIONS)
        for name in ("device_memory", "host_budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainConfig.{name} must be a positive number of bytes, got {value!r}")
        for name in ("block_size", "batch_size", "steps", "grad_accum", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TrainConfig.seed must be an int, got {self.seed!r}")
        if not isinstance(self.lr, (int, float)) or not (0 < self.lr < math.inf):
            raise ValueError(f"TrainConfig.lr must be a positive finite number, got {self.lr!r}")
        names = self.activations.split(",") if isinstance(self.activations, str) else [None]
        if any(name not in POLICIES for name in names):
            raise ValueError(f"TrainConfig.activations must be one of {', '.join(POLICIES)}, or one per block "
                             f"separated by commas; got {self.activations!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"TrainConfig.offload must be True or False, got {self.offload!r}")
        if not isinstance(self.optimizer, OffloadOptions):
            raise ValueError("TrainConfig.optimizer must be an OffloadOptions (minioffload.options), got "
                             f"{type(self.optimizer).__name__}")
        if self.nvme_dir is not None and not self.offload:
            raise ValueError("TrainConfig.nvme_dir keeps OffloadAdam's state in files (its NVMe tier), and "
                             "offload=False keeps torch's AdamW on the device: set offload=True or drop nvme_dir")
        try:
            placement = self.placement
        except ValueError as err:  # a field's own check: "params_on must be one of ..."
            raise ValueError(f"TrainConfig.{err}") from None
        if self.params_on == "nvme" and self.nvme_dir is None and self.weights_dir is None:
            raise ValueError("TrainConfig.params_on='nvme' keeps the weights in files: give TrainConfig.weights_dir "
                             "(the optimizer's state stays in host memory), or nvme_dir (both on NVMe, the weights "
                             "in nvme_dir/weights)")
        if self.weights_dir is not None and self.params_on != "nvme":
            raise ValueError(f"TrainConfig.weights_dir is the home of weights streamed from NVMe, and params_on is "
                             f"{self.params_on!r}: set params_on='nvme' or drop weights_dir")
        check_run(placement, self.optimizer)
        if self.host_budget is not None and (self.params_on == "nvme" or self.checkpoint_every is not None):
            raise ValueError("TrainConfig.host_budget: the pinned buffers of weights streamed from NVMe "
                             "(params_on='nvme') and of lazy checkpoints (checkpoint_every) are not counted yet: drop "
                             "host_budget, or stream the weights from the host and checkpoint at the end "
                             "(checkpoint_dir alone)")
        if self.checkpoint_every is not None:
            if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                    or self.checkpoint_every < 1:
                raise ValueError(f"TrainConfig.checkpoint_every must be a positive int, got {self.checkpoint_every!r}")
            if self.checkpoint_dir is None or self.shard or not self.offload:
                raise ValueError("TrainConfig.checkpoint_every writes lazy asynchronous checkpoints of one process's "
                                 "OffloadAdam into checkpoint_dir: give checkpoint_dir, offload=True and no shard")

    @property
    def placement(self) -> Placement:
        """Where this run keeps its state: offload=False is the optimizer on the device (torch's AdamW), nvme_dir its
        NVMe tier; shard, the state sharded over torchrun's ranks (WORLD_SIZE, and at least 2: a sharded run is
        checked as one of several ranks)."""
        optimizer_on = "device" if not self.offload else "host" if self.nvme_dir is None else "nvme"
        ranks = max(2, int(os.environ.get("WORLD_SIZE", 2))) if self.shard else 1
        return Placement(optimizer_on=optimizer_on, params_on=self.params_on, prefetch=self.prefetch, ranks=ranks,
                         grads_on=self.grads_on)


def _choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"TrainConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
