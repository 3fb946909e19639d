"""What a plan is: the model to train, the machine's limits, and one configuration of the runtime with what the
step model and the byte counts predict for it. Written to and read from JSON (`Plan.save`, `Plan.load`).

    spec = ModelSpec.of_params(70e9, seq_len=4096)      # a GPT-3-family shape of about 70B parameters
    spec = ModelSpec.of_preset("small")                 # one of the course's GPTs (models.GPTConfig presets)
    plan = Plan.load("plan.json"); plan.memory["host"]  # bytes of pinned host memory it needs

A `Plan` names where each part of the training state lives:

    weights       params_on      "device" (resident) | "host" | "nvme" (streamed block by block, chapter 8)
    gradients     gradients_on   "device" with the optimizer on the device, else `grads_on`: "host" (the engine
                                 sums every micro-batch's gradients in pinned host memory, chapter 3) or "nvme"
                                 (through a few pinned sets to the optimizer's drive, chapter 12)
    optimizer     optimizer_on   "device" (torch AdamW) | "host" (OffloadAdam) | "nvme" (its NVMe tier, chapter 6)
    activations   activations    one chapter 7 policy per block

on `ranks` processes (one device each: the optimizer state sharded over them, `memory` per rank), and how the update
runs (`gpu_fraction` of the optimizer's subgroups updated on the device, chapter 5; `delay`,
chapter 4), the prefetch depth, the subgroup size and the batch (micro_batch sequences x grad_accum).

Its `placement` and `options` are the settings' vocabulary (options.py), checked by their one table of rules; a plan
runs through its `train_config()` and is predicted through its `step_config()`, written here once.

What this is not: the search (planner/search.py), nor a check of this machine (planner/doctor.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..options import HOMES, OffloadOptions, Placement, check_model, check_run
from ..predict.activation_cost import POLICIES
from ..predict.shapes import ModelSpec
from ..predict.step_config import StepConfig
from ..units import format_bytes

PLAN_PRECISIONS = ("fp32", "mixed_bf16")  # what the runtime trains: fp32, or bf16 weights with fp32 masters
FORMAT = "minioffload-plan/1"
CLIP = 1.0  # the gradient norm a plan's run clips to (its prediction counts the pass)


@dataclass(frozen=True)
class Plan:
    """One configuration of the runtime for `model` on the profile named `hardware`, with its predictions."""

    model: ModelSpec
    hardware: str
    precision: str
    micro_batch: int  # sequences per forward and backward
    grad_accum: int  # micro-batches per optimizer step
    optimizer_on: str  # "device" | "host" | "nvme"
    params_on: str  # "device" | "host" | "nvme"
    activations: tuple[str, ...]  # one policy per block
    prefetch: int = 0  # streamed weights: blocks fetched ahead (0 when resident)
    subgroup_numel: int = 1 << 22
    delay: bool = False
    gpu_fraction: float | None = None  # share of the optimizer's subgroups updated on the device (hybrid)
    # predictions
    step_s: float = 0.0
    memory: dict = field(default_factory=dict)  # tier -> bytes: "device", "host" (pinned), "nvme"
    bound: str = ""  # the resource that sets the step's length (stepmodel.Prediction.bound)
    busy: dict = field(default_factory=dict)  # lane -> predicted busy seconds per step (stepmodel's lanes)
    capacity: dict = field(default_factory=dict)  # tier -> bytes the plan was made for (None: unbounded)
    ranks: int = 1  # processes, one device each: the optimizer state sharded over them (memory and capacity per rank)
    grads_on: str = "host"  # offloaded: where the gradients wait for the update, "host" or "nvme" (with the state)

    def __post_init__(self) -> None:
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {', '.join(PLAN_PRECISIONS)}, got {self.precision!r}")
        if len(self.activations) != self.model.n_layer or any(p not in POLICIES for p in self.activations):
            raise ValueError(f"Plan.activations must name one policy of {', '.join(POLICIES)} per block "
                             f"({self.model.n_layer}), got {self.activations!r}")
        try:
            placement, options = self.placement, self.options
        except ValueError as err:  # a field's own check: "ranks must be an int >= 1 ..."
            raise ValueError(f"Plan.{err}") from None
        try:  # a plan runs (train) as the step model predicted it
            check_run(placement, options)
            check_model(placement, options)
        except ValueError as err:
            raise ValueError(f"Plan: {err}") from None

    @property
    def placement(self) -> Placement:
        return Placement(optimizer_on=self.optimizer_on, params_on=self.params_on, prefetch=self.prefetch,
                         ranks=self.ranks, grads_on=self.grads_on)

    @property
    def options(self) -> OffloadOptions:
        """OffloadAdam's options of this plan: its subgroups, its update (delayed, or gpu_fraction of the subgroups
        on the device) and gradients clipped to norm 1 (as the planner predicts and train runs them)."""
        return OffloadOptions(subgroup_numel=self.subgroup_numel, max_grad_norm=CLIP,
                              delay_updates_after=0 if self.delay else None, gpu_fraction=self.gpu_fraction)

    def step_config(self, mfu: float = 0.4) -> StepConfig:
        """The step model's configuration of this plan (stepmodel.predict of one micro-batch)."""
        return StepConfig(self.placement, self.options, mfu)

    def train_config(self, **overrides):
        """The TrainConfig that runs this plan (a course GPT's): its model, batch, precision, homes, policies and
        optimizer options; `overrides` set the rest (device, steps, nvme_dir, out_dir, ...). A plan of ranks > 1
        runs under `torchrun --nproc-per-node {ranks}` (shard=True: the ranks come from torchrun)."""
        from ..train.loop import TrainConfig

        if self.model.preset is None:
            raise ValueError(f"this plan is for a {self.model}, which `train` does not build: it trains the course's "
                             "GPT presets. Make a plan with --model tiny|small|medium|gpt2-small-ish to run one")
        needs_nvme = "nvme" in (self.optimizer_on, self.params_on)
        if needs_nvme and overrides.get("nvme_dir") is None and overrides.get("weights_dir") is None:
            raise ValueError(f"this plan keeps the {'optimizer state' if self.optimizer_on == 'nvme' else 'weights'} "
                             "on NVMe: give nvme_dir (--nvme-dir DIR on the drive)")
        if not needs_nvme:
            overrides.pop("nvme_dir", None)
        elif self.optimizer_on != "nvme" and overrides.get("weights_dir") is None:  # only the weights go there
            overrides["weights_dir"] = overrides.pop("nvme_dir")
        elif self.optimizer_on != "nvme":
            overrides.pop("nvme_dir", None)
        if self.ranks > 1:
            overrides["shard"] = True
        activations = self.activations[0] if len(set(self.activations)) == 1 else ",".join(self.activations)
        return TrainConfig(model=self.model.preset, block_size=self.model.seq_len, batch_size=self.micro_batch,
                           grad_accum=self.grad_accum, precision="fp32" if self.precision == "fp32" else "bf16",
                           offload=self.placement.offloaded, optimizer=self.options, activations=activations,
                           params_on=self.params_on, prefetch=self.prefetch, grads_on=self.grads_on, **overrides)

    @property
    def gradients_on(self) -> str:
        return "device" if self.optimizer_on == "device" else self.grads_on

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step of the whole job: every rank's micro-batches."""
        return self.micro_batch * self.grad_accum * self.model.seq_len * self.ranks

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    def describe(self) -> str:
        """One line: where each state lives and the knobs."""
        acts = sorted(set(self.activations), key=self.activations.index)
        knobs = [f"weights {self.params_on}" + (f" (prefetch {self.prefetch})" if self.params_on != "device" else ""),
                 f"grads {self.gradients_on}", f"optimizer {self.optimizer_on}",
                 f"activations {'/'.join(acts)}" + (f" ({self.activations.count(acts[0])}/{len(self.activations)})"
                                                    if len(acts) > 1 else "")]
        if self.optimizer_on != "device":
            knobs.append(f"subgroups of {self.subgroup_numel / 2 ** 20:g}M")
        if self.gpu_fraction:
            knobs.append(f"gpu_fraction {self.gpu_fraction:.2f}")
        if self.delay:
            knobs.append("delayed update")
        knobs.append(f"batch {self.micro_batch} x {self.grad_accum}")
        if self.ranks > 1:
            knobs.append(f"{self.ranks} ranks" + (" (optimizer state sharded)" if self.optimizer_on != "device" else
                                                  " (data parallel)"))
        return ", ".join(knobs)

    def activations_line(self) -> str:
        """The policies block by block, runs folded: "recompute x3, keep x9"."""
        runs: list[list] = []
        for policy in self.activations:
            if runs and runs[-1][0] == policy:
                runs[-1][1] += 1
            else:
                runs.append([policy, 1])
        return ", ".join(f"{p} x{n}" if n > 1 else p for p, n in runs)

    def memory_line(self) -> str:
        return ", ".join(f"{tier} {format_bytes(self.memory[tier])}" for tier in HOMES if tier in self.memory)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["activations"] = list(self.activations)
        return {"format": FORMAT, **out, "tokens_per_s": self.tokens_per_s, "gradients_on": self.gradients_on}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a minioffload plan (format {data.get('format')!r}, expected {FORMAT!r}): write "
                             "one with `python -m minioffload plan ... --out plan.json`")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        fields["model"] = ModelSpec(**fields["model"])
        fields["activations"] = tuple(fields["activations"])
        return cls(**fields)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"no plan at {path}: write one with `python -m minioffload plan ... --out {path}`") \
                from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not JSON ({err}); a plan is written by `python -m minioffload plan`") \
                from None
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: a plan field is missing or unknown ({err}); write the plan again with "
                             "`python -m minioffload plan`") from None
