"""Hugging Face's Trainer with OffloadAdam: `OffloadTrainer` clips, and logs the gradient norm, through the optimizer.

    opt = OffloadAdam(dev.place(model).parameters(), dev, lr=1e-3)
    trainer = OffloadTrainer(model, args, train_dataset=data, optimizers=(opt, scheduler))
    trainer.train()                                   # clipped to args.max_grad_norm; "grad_norm" logged as it is

The Trainer clips with accelerate's clip_grad_norm_ over `model.parameters()`, whose `.grad` OffloadAdam has already
taken to the host: a plain Trainer with OffloadAdam clips nothing and logs a gradient norm of 0.0, and there is no
public hook through which the optimizer could refuse that. OffloadTrainer asks the OffloadAdam instead (unwrapped
from accelerate's AcceleratedOptimizer); with any other optimizer it is the Trainer, unchanged.

Checkpoints need nothing extra: the Trainer saves `optimizer.state_dict()` (OffloadAdam's fp32 masters and moments)
and the model's safetensors; a subgroup's parameters are views of one flat tensor, which transformers' save finds to be
disjoint and saves as separate tensors. Resuming loads the weights into the same parameters, then the optimizer state.

What this is not: a Trainer that creates an OffloadAdam (pass it in `optimizers=`), nor a way to run OffloadAdam under
the Trainer's DeepSpeed or FSDP (DeepSpeed's engine runs its own optimizer step; the Trainer refuses `optimizers=` with
FSDP).
"""

from __future__ import annotations

import transformers

from . import offload_adam_of

# The Trainer's own methods overridden below. They are private (a transformers release may rename them; the tests
# assert they exist), and they are the only place the Trainer clips and measures gradients:
#   _clip_grad_norm(model)             clips to args.max_grad_norm; returns the norm before clipping
#   _get_grad_norm(model, grad_norm)   the norm to log; measures it (clip_grad_norm_ to inf) when nothing clipped
OVERRIDDEN = ("_clip_grad_norm", "_get_grad_norm")


class OffloadTrainer(transformers.Trainer):
    """A Trainer whose clipping and logged gradient norm go through OffloadAdam.clip_grad_norm_ (when the optimizer
    is an OffloadAdam). Build the OffloadAdam without `max_grad_norm`: the Trainer clips (args.max_grad_norm)."""

    def _offload_adam(self):
        return offload_adam_of(self.optimizer)

    def _clip_grad_norm(self, model):
        opt = self._offload_adam()
        if opt is None:
            return super()._clip_grad_norm(model)
        return opt.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        opt = self._offload_adam()
        if opt is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        if opt.options.max_grad_norm is not None:  # it clips inside step(); the norm is known after it (last_grad_norm)
            return None
        return opt.clip_grad_norm_(float("inf"))  # args.max_grad_norm=0: measured, not clipped
