"""Hugging Face's Trainer with OffloadAdam (minioffload/integrations/hf_trainer.py): OffloadTrainer clips and logs the
gradient norm as a Trainer with torch's AdamW does, resumes from its own checkpoint exactly, and a plain Trainer's
silent non-clipping is pinned down (there is no public hook through which it could be refused)."""

import pytest
import torch
from hf_models import batch, tiny

transformers = pytest.importorskip("transformers")

from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.integrations.hf_trainer import OVERRIDDEN, OffloadTrainer  # noqa: E402

# Llama for the comparisons with AdamW: GPT-2's attention key bias has a gradient of exactly zero in exact arithmetic,
# so in fp32 it is rounding noise, which Adam divides by its own size (about eps): a noise of a noise, not comparable.
# GPT-2 for the checkpoint: its head is tied to the embedding, and the checkpoint saves one of the two.
COMPARED, TIED = "llama", "gpt2"
CLIP, STEPS = 0.05, 4  # the tiny model's gradient norm is about 1: every step clips


@pytest.fixture(autouse=True)
def quiet():
    """The Trainer's notes on a tied head missing from the checkpoint (it is tied again on load) and the like."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


class Samples(torch.utils.data.Dataset):
    def __init__(self, family, n=2 * 2 * STEPS):  # batch 2, 2 micro-batches per step
        self.items = [{key: value[0] for key, value in batch(family, seed=i).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def arguments(output_dir, **overrides):
    fields = dict(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_grad_norm=CLIP, learning_rate=1e-2, weight_decay=0.1,
                  use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    return transformers.TrainingArguments(**{**fields, **overrides})


def train(trainer_class, output_dir, dev=None, resume=None, family=COMPARED, **overrides):
    """A run of `trainer_class` on the tiny model, with OffloadAdam on `dev` (torch's AdamW without one) and a warmup
    schedule; its parameters afterwards and the gradient norms it logged."""
    args = arguments(output_dir, **overrides)
    model = tiny(family)
    if dev is not None:
        model = dev.place(model)
        opt = OffloadAdam(model.parameters(), dev, lr=args.learning_rate, weight_decay=args.weight_decay,
                          subgroup_numel=1 << 12)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    parameters = list(model.parameters())
    trainer = trainer_class(model=model, args=args, train_dataset=Samples(family),
                            optimizers=(opt, scheduler))
    trainer.train(resume_from_checkpoint=resume)
    assert list(model.parameters()) == parameters  # trained in place: still the optimizer's parameters
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    return [p.detach().clone() for p in model.parameters()], norms


def test_the_overridden_trainer_methods_still_exist():
    # private methods: a transformers release that renames them must fail here, not clip nothing in silence
    for name in OVERRIDDEN:
        assert callable(getattr(transformers.Trainer, name, None)), f"transformers.Trainer.{name} is gone"
        assert name in vars(OffloadTrainer)


def test_offload_trainer_clips_and_logs_like_a_trainer_with_adamw(sim, tmp_path):
    ours, our_norms = train(OffloadTrainer, tmp_path / "ours", sim)
    theirs, their_norms = train(transformers.Trainer, tmp_path / "theirs")
    unclipped, _ = train(transformers.Trainer, tmp_path / "unclipped", max_grad_norm=0)
    assert len(our_norms) == len(their_norms) == STEPS
    assert all(norm > CLIP for norm in their_norms)  # clipping happened
    torch.testing.assert_close(torch.tensor(our_norms), torch.tensor(their_norms))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    assert not all(torch.allclose(a, b) for a, b in zip(unclipped, theirs, strict=True))  # the clip mattered


def test_offload_trainer_logs_the_norm_when_it_does_not_clip(sim, tmp_path):
    ours, our_norms = train(OffloadTrainer, tmp_path / "ours", sim, max_grad_norm=0)
    theirs, their_norms = train(transformers.Trainer, tmp_path / "theirs", max_grad_norm=0)
    assert all(norm > CLIP for norm in our_norms)
    torch.testing.assert_close(torch.tensor(our_norms), torch.tensor(their_norms))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_offload_trainer_resumes_from_its_checkpoint_bit_for_bit(sim, tmp_path):
    straight, straight_norms = train(OffloadTrainer, tmp_path / "straight", sim, family=TIED)
    first, _ = train(OffloadTrainer, tmp_path / "first", sim, family=TIED, save_strategy="steps",
                     save_steps=STEPS // 2)
    assert all(torch.equal(a, b) for a, b in zip(first, straight, strict=True))  # saving changes nothing
    checkpoint = tmp_path / "first" / f"checkpoint-{STEPS // 2}"

    # the safetensors file holds every weight as it was (views of one flat tensor each, saved apart), but for the
    # tied head, which is the embedding
    from safetensors.torch import load_file
    saved = load_file(checkpoint / "model.safetensors")
    masters = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    names = [name for name, _ in tiny(TIED).named_parameters()]  # one name for the tied pair
    assert sorted(saved) == sorted(names) and len(masters) == len(names)
    for index, name in enumerate(names):  # an fp32 model's weights are its masters
        assert torch.equal(saved[name], masters[index]["master"].reshape(saved[name].shape)), name

    resumed, resumed_norms = train(OffloadTrainer, tmp_path / "resumed", sim, resume=str(checkpoint), family=TIED,
                                   save_strategy="steps", save_steps=STEPS // 2)
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))
    assert resumed_norms == straight_norms  # the first half from the checkpoint's log, the rest measured again


def test_a_plain_trainer_with_offload_adam_clips_nothing_and_logs_zero(sim, tmp_path):
    # what OffloadTrainer exists for: torch's clip_grad_norm_ over parameters whose .grad OffloadAdam has taken
    plain, plain_norms = train(transformers.Trainer, tmp_path / "plain", sim)
    unclipped, _ = train(transformers.Trainer, tmp_path / "unclipped", max_grad_norm=0)
    assert plain_norms == [0.0] * STEPS
    for a, b in zip(plain, unclipped, strict=True):
        torch.testing.assert_close(a, b)


def test_an_offload_adam_that_clips_itself_is_refused_by_offload_trainer(sim, tmp_path):
    model = sim.place(tiny(COMPARED))
    opt = OffloadAdam(model.parameters(), sim, max_grad_norm=1.0)
    trainer = OffloadTrainer(model=model, args=arguments(tmp_path), train_dataset=Samples(COMPARED),
                             optimizers=(opt, None))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="clip in one place"):
        trainer.train()  # at the first step, before any update
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
