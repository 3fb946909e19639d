"""What a plan is: the model to train, the machine's limits, and one configuration of the runtime with what the
step model and the byte counts predict for it. Written to and read from JSON (`Plan.save`, `Plan.load`).

    spec = ModelSpec.of_params(70e9, seq_len=4096)      # a GPT-3-family shape of about 70B parameters
    spec = ModelSpec.of_preset("small")                 # one of the course's GPTs (models.GPTConfig presets)
    plan = Plan.load("plan.json"); plan.memory["host"]  # bytes of pinned host memory it needs

A `Plan` names where each part of the training state lives:

    weights       params_on      "device" (resident) | "host" | "nvme" (streamed block by block, chapter 8)
    gradients     gradients_on   "device" with the optimizer on the device, else "host" (the engine sums every
                                 micro-batch's gradients in pinned host memory, chapter 3)
    optimizer     optimizer_on   "device" (torch AdamW) | "host" (OffloadAdam) | "nvme" (its NVMe tier, chapter 6)
    activations   activations    one chapter 7 policy per block

on `ranks` processes (one device each: the optimizer state sharded over them, `memory` per rank), and how the update
runs (`gpu_fraction` of the optimizer's subgroups updated on the device, chapter 5; `delay`,
chapter 4), the prefetch depth, the subgroup size and the batch (micro_batch sequences x grad_accum).

What this is not: the search (planner/search.py), nor a check of this machine (planner/doctor.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..predict.activation_cost import POLICIES
from ..units import format_bytes

HOMES = ("device", "host", "nvme")
PLAN_PRECISIONS = ("fp32", "mixed_bf16")  # what the runtime trains: fp32, or bf16 weights with fp32 masters
FORMAT = "minioffload-plan/1"


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: `n_layer` blocks `d_model` wide with `n_head` heads, a vocabulary of `vocab` tokens, context
    `seq_len`, biases and a tied head (models.GPT and GPT-3's layout). `preset`: the course GPT it is, if any."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    preset: str | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"ModelSpec: d_model ({self.d_model}) must split into n_head ({self.n_head}) heads")

    @property
    def block_params(self) -> int:
        """Attention (4 d^2 + 4 d), MLP (8 d^2 + 5 d), two LayerNorms (4 d)."""
        return 12 * self.d_model ** 2 + 13 * self.d_model

    @property
    def resident_params(self) -> int:
        """Token and position embeddings (the head is tied to the first) and the final LayerNorm."""
        return (self.vocab + self.seq_len + 2) * self.d_model

    @property
    def num_params(self) -> int:
        return self.n_layer * self.block_params + self.resident_params

    @property
    def num_tensors(self) -> int:
        return 12 * self.n_layer + 4  # per block: 4 Linear (weight, bias) and 2 LayerNorm (weight, bias)

    @classmethod
    def of_params(cls, num_params: float, seq_len: int = 2048, vocab: int = 50257) -> ModelSpec:
        """GPT-3's shape family (streaming_cost.shape_for) at about `num_params` parameters."""
        from ..predict.streaming_cost import shape_for

        if not num_params >= 1e8:
            raise ValueError(f"num_params must be at least 1e8 for a GPT-3-family shape (the smallest, GPT-3 Small, "
                             f"has 125M); got {num_params!r}. For a course GPT use ModelSpec.of_preset")
        s = shape_for(num_params)
        return cls(s.n_layer, s.d_model, s.n_head, vocab, seq_len)

    @classmethod
    def of_preset(cls, name: str, block_size: int | None = None, vocab: int | None = None) -> ModelSpec:
        """A course GPT (models.GPTConfig preset) on the bundled text's characters unless `vocab` is given."""
        from ..model.gpt import CharTokenizer, GPTConfig, load_text

        if vocab is None:
            vocab = CharTokenizer(load_text()).vocab_size
        overrides = {} if block_size is None else {"block_size": block_size}
        c = GPTConfig.preset(name, vocab_size=vocab, **overrides)
        return cls(c.n_layer, c.n_embd, c.n_head, vocab, c.block_size, preset=name)

    def __str__(self) -> str:
        what = f"GPT '{self.preset}'" if self.preset else "GPT"
        return f"{what} of {self.num_params / 1e9:.3g}B ({self.n_layer} x {self.d_model}, {self.n_head} heads, " \
               f"context {self.seq_len})"


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

    def __post_init__(self) -> None:
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {', '.join(PLAN_PRECISIONS)}, got {self.precision!r}")
        for name in ("optimizer_on", "params_on"):
            if getattr(self, name) not in HOMES:
                raise ValueError(f"Plan.{name} must be one of {', '.join(HOMES)}, got {getattr(self, name)!r}")
        if len(self.activations) != self.model.n_layer or any(p not in POLICIES for p in self.activations):
            raise ValueError(f"Plan.activations must name one policy of {', '.join(POLICIES)} per block "
                             f"({self.model.n_layer}), got {self.activations!r}")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"Plan.ranks must be an int >= 1, got {self.ranks!r}")
        if self.ranks > 1 and (self.optimizer_on == "device" or self.params_on != "device" or self.delay
                               or self.gpu_fraction):
            raise ValueError(f"Plan: ranks={self.ranks} shards the offloaded optimizer with every weight on each "
                             "device and the synchronous update: optimizer_on 'host' or 'nvme', params_on 'device', no "
                             "delay or gpu_fraction")
        if self.optimizer_on == "device" and (self.params_on != "device" or self.delay or self.gpu_fraction):
            raise ValueError("Plan: streamed weights, the delayed update and gpu_fraction need the optimizer "
                             "offloaded (optimizer_on 'host' or 'nvme')")

    @property
    def gradients_on(self) -> str:
        return "device" if self.optimizer_on == "device" else "host"

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
