"""OffloadAdam inside the training loops people already use: Hugging Face's Trainer (`hf_trainer.py`) and Lightning
(`lightning.py`). Both loops clip with torch.nn.utils.clip_grad_norm_ over the parameters' `.grad`, which OffloadAdam
has already taken to the host: each module routes the loop's clipping (and the gradient norm it logs) to
`OffloadAdam.clip_grad_norm_`. A plain PyTorch loop needs nothing from here: call `opt.clip_grad_norm_(c)` where it
called torch's.

    from minioffload.integrations.hf_trainer import OffloadTrainer        # needs transformers
    from minioffload.integrations.lightning import OffloadClipping         # needs lightning

What this is not: an import of either framework. Importing this package (or minioffload) never imports transformers or
lightning; only the module of a framework does, and only when you import it.
"""

from __future__ import annotations

import torch

from ..engine.optimizer import OffloadAdam

__all__ = ["offload_adam_of"]


def offload_adam_of(optimizer) -> OffloadAdam | None:
    """The OffloadAdam a loop holds: `optimizer` itself, or the one inside the framework's wrapper (accelerate's
    AcceleratedOptimizer and Lightning's LightningOptimizer keep it as `.optimizer`); None for any other optimizer.
    Unwrapped first: a LightningOptimizer passes isinstance checks for the class it wraps, but writes to itself."""
    for _ in range(4):  # wrappers of wrappers, a few deep at most
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, OffloadAdam) else None
