"""Lightning with OffloadAdam (minioffload/integrations/lightning.py): automatic optimisation (Trainer's
gradient_clip_val, accumulate_grad_batches) and manual optimisation (manual_backward, clip_gradients or the optimizer's
own clip_grad_norm_, step) train like torch's AdamW in the same module; a checkpoint resumes exactly."""

import warnings

import pytest
import torch
from hf_models import batch, loss_of, tiny

pl = pytest.importorskip("lightning.pytorch")

from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.integrations.lightning import OffloadClipping  # noqa: E402

FAMILY, CLIP, STEPS = "llama", 0.05, 4  # the tiny model's gradient norm is about 1: every step clips
HYPER = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture(autouse=True)
def quiet():
    """Lightning's notes that do not apply here (workers of a tiny CPU data loader, a deprecation inside Lightning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        warnings.filterwarnings("ignore", ".*exists and is not empty.*")  # the resumed run saves beside the first
        yield


class Samples(torch.utils.data.Dataset):
    def __init__(self, n=2 * 2 * STEPS):  # batch 2, 2 micro-batches per step
        self.items = [{key: value[0] for key, value in batch(FAMILY, seed=i).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


class Automatic(OffloadClipping, pl.LightningModule):
    """The tiny model with OffloadAdam on `dev`, or torch's AdamW without one; a warmup schedule stepped per step."""

    def __init__(self, dev=None, steps_per_epoch=STEPS):
        super().__init__()
        self.net, self.dev, self.steps_per_epoch = tiny(FAMILY), dev, steps_per_epoch
        if dev is not None:
            dev.place(self.net)
        self.norms = []  # what clip_gradients returned, per step

    def training_step(self, inputs, index):
        return loss_of(self.net, inputs)

    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        norm = super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append(norm)
        return norm

    def configure_optimizers(self):
        if self.dev is not None:
            opt = OffloadAdam(self.parameters(), self.dev, subgroup_numel=1 << 12, **HYPER)
        else:
            opt = torch.optim.AdamW(self.parameters(), foreach=False, **HYPER)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Samples(4 * self.steps_per_epoch), batch_size=2)


class Manual(Automatic):
    """The same, optimised by hand: two micro-batches per step, clipped by `clip(module, optimizer)`."""

    def __init__(self, dev=None, clip=lambda module, opt: module.clip_gradients(opt, CLIP, "norm")):
        super().__init__(dev)
        self.automatic_optimization, self.clip = False, clip

    def training_step(self, inputs, index):
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        self.manual_backward(loss_of(self.net, inputs) / 2)
        if index % 2 == 1:
            self.clip(self, opt)
            opt.step()
            scheduler.step()
            opt.zero_grad()


def fit(module, ckpt_path=None, **options):
    """`module` fitted on a CPU Trainer; its parameters afterwards."""
    settings = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, max_steps=STEPS)
    pl.Trainer(**{**settings, **options}).fit(module, ckpt_path=ckpt_path)
    return [p.detach().clone() for p in module.net.parameters()]


AUTOMATIC = dict(accumulate_grad_batches=2, gradient_clip_val=CLIP)


def assert_close_all(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_automatic_optimisation_matches_adamw(sim):
    module = Automatic(sim)
    ours = fit(module, **AUTOMATIC)
    reference = Automatic()
    theirs = fit(reference, **AUTOMATIC)
    assert len(module.norms) == STEPS and all(norm > CLIP for norm in module.norms)  # clipped, through OffloadAdam
    assert reference.norms == [None] * STEPS  # Lightning's own clipping (returns nothing)
    assert_close_all(ours, theirs)
    unclipped = fit(Automatic(), accumulate_grad_batches=2)
    assert not all(torch.allclose(a, b) for a, b in zip(unclipped, theirs, strict=True))  # the clip mattered


@pytest.mark.parametrize("clip", [
    lambda module, opt: module.clip_gradients(opt, CLIP, "norm"),
    lambda module, opt: opt.clip_grad_norm_(CLIP),  # on Lightning's wrapper, which forwards reads only
], ids=["clip_gradients", "clip_grad_norm_"])
def test_manual_optimisation_matches_adamw(sim, clip):
    ours = fit(Manual(sim, clip))
    theirs = fit(Manual())  # clip_gradients: Lightning's own
    assert_close_all(ours, theirs)


def test_clipping_by_value_is_refused(sim):
    with pytest.raises(ValueError, match="global L2 norm only"):
        fit(Automatic(sim), accumulate_grad_batches=2, gradient_clip_val=CLIP, gradient_clip_algorithm="value")


def test_a_checkpoint_resumes_bit_for_bit(sim, tmp_path):
    # checkpoints at the end of each epoch: Lightning cannot resume a plain data loader mid-epoch exactly
    half = STEPS // 2
    options = dict(AUTOMATIC, max_epochs=2, max_steps=-1)
    straight = fit(Automatic(sim, steps_per_epoch=half), **options)

    def saving(directory):
        return [pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)]

    first = fit(Automatic(sim, steps_per_epoch=half), enable_checkpointing=True, callbacks=saving(tmp_path),
                **options)
    assert all(torch.equal(a, b) for a, b in zip(first, straight, strict=True))
    checkpoint = tmp_path / f"epoch=0-step={half}.ckpt"
    resumed = fit(Automatic(sim, steps_per_epoch=half), ckpt_path=checkpoint, enable_checkpointing=True,
                  callbacks=saving(tmp_path), **options)
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))
