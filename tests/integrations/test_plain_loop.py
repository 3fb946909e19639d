"""OffloadAdam in a plain PyTorch loop on GPT-2, Llama and BERT: an LR scheduler with warmup, gradient accumulation
over two micro-batches and clipping through `opt.clip_grad_norm_` train like torch's AdamW with torch's
clip_grad_norm_, within torch's default fp32 tolerances (the norm's partial sums are float64 per subgroup here, fp32
per tensor there)."""

import pytest
import torch
from hf_models import FAMILIES, batch, loss_of, tiny

from minioffload.engine.optimizer import OffloadAdam

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CLIP, STEPS, MICRO_BATCHES = 0.5, 3, 2


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))


def train(family, model, opt, clip):
    """STEPS steps of MICRO_BATCHES micro-batches each, clipped by `clip(max_norm)`; the norms it returned."""
    scheduler, norms = warmup(opt), []
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            (loss_of(model, batch(family, seed=MICRO_BATCHES * step + micro)) / MICRO_BATCHES).backward()
        norms.append(clip(CLIP))
        opt.step()
        scheduler.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("family", FAMILIES)
def test_offload_adam_matches_adamw_in_a_plain_loop(sim, family):
    ours = sim.place(tiny(family))
    opt = OffloadAdam(ours.parameters(), sim, subgroup_numel=1 << 12, **HYPER)
    assert len(opt.subgroups) > 3  # flat device tensors of several parameters each
    our_norms = train(family, ours, opt, opt.clip_grad_norm_)
    sim.synchronize()

    theirs = tiny(family)
    reference = torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER)
    their_norms = train(family, theirs, reference,
                        lambda max_norm: torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm))

    assert all(norm > CLIP for norm in their_norms)  # every step clipped
    torch.testing.assert_close(torch.stack(our_norms), torch.stack(their_norms))
    assert opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == HYPER["lr"]  # warmed up
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
