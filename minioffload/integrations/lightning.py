"""Lightning with OffloadAdam: `OffloadClipping`, a LightningModule mixin that clips through the optimizer.

    class Model(OffloadClipping, L.LightningModule):      # the mixin first, so its clip_gradients is the one called
        def configure_optimizers(self):
            return OffloadAdam(self.parameters(), dev, lr=1e-3)

    L.Trainer(gradient_clip_val=1.0, ...).fit(Model())     # automatic optimisation: clipped by norm, as usual
    self.clip_gradients(opt, gradient_clip_val=1.0)        # manual optimisation, after manual_backward, before step

Lightning clips in `LightningModule.clip_gradients` (automatic optimisation calls it from the default
`configure_gradient_clipping`, after the closure's backward and before the optimizer's step; manual optimisation calls
it itself), through its precision plugin, with torch.nn.utils.clip_grad_norm_ over the parameters' `.grad`, which
OffloadAdam has already taken to the host: it would clip nothing. The mixin sends it to `OffloadAdam.clip_grad_norm_`
and returns the norm before clipping (Lightning's returns None); any other optimizer goes to Lightning's own. Calling
`opt.clip_grad_norm_(c)` on the optimizer (in manual optimisation, `self.optimizers().optimizer`) works as well.

Checkpoints need nothing extra: Lightning saves `optimizer.state_dict()` (the fp32 masters and moments) beside the
model's state_dict, and `fit(ckpt_path=...)` loads the weights into the same parameters, then the optimizer state.

What this is not: clipping by value (OffloadAdam clips by the global L2 norm only: refused), or a logger of the norm
(Lightning's `grad_norm` utility reads `.grad` too and sees none).
"""

from __future__ import annotations

import torch

from . import offload_adam_of


class OffloadClipping:
    """Mix into a LightningModule (before it in the bases): its gradient clipping goes through OffloadAdam."""

    # Lightning's docstring asks to override configure_gradient_clipping instead; but manual optimisation calls
    # clip_gradients directly, and both paths meet here, so this one method covers both.
    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> torch.Tensor | None:
        offload = offload_adam_of(optimizer)
        if offload is None:
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        max_norm = self.trainer.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        algorithm = gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm"
        if str(getattr(algorithm, "value", algorithm)).lower() != "norm":
            raise ValueError(f"OffloadAdam clips by the global L2 norm only, not by {algorithm!r}: use "
                             "gradient_clip_algorithm='norm'")
        if not max_norm:  # None or 0: Lightning does not clip either
            return None
        return offload.clip_grad_norm_(max_norm)
