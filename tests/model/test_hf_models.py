"""Hugging Face models (GPT-2, Llama, BERT) under the runtime: their block stacks are found, and every activation
policy, streamed weights and OffloadAdam train them bit for bit like the plain model, on the strict sim."""

import pytest
import torch

hf_models = pytest.importorskip("hf_models")  # skips without transformers (the `integrations` extra)

from hf_models import FAMILIES, batch, loss_of, tiny  # noqa: E402

from minioffload.devices import device  # noqa: E402
from minioffload.engine.optimizer import OffloadAdam  # noqa: E402
from minioffload.model.activations import Activations  # noqa: E402
from minioffload.model.streaming import ParamStreamer, find_blocks  # noqa: E402
from minioffload.nvme.swapper import Swapper  # noqa: E402

transformers = hf_models.transformers
POLICIES = ("keep", "recompute", "offload", "offload_input")
STACKS = {"gpt2": lambda m: m.transformer.h, "llama": lambda m: m.model.layers, "bert": lambda m: m.bert.encoder.layer}


def _train(family, policy="keep", streamed=False, steps=3, swapper=None):
    """Masters, state_dict and losses after `steps` OffloadAdam steps; how often each block ran forward; the run."""
    with device("sim") as dev:
        model = tiny(family)
        streamer = None
        if streamed:
            streamer = ParamStreamer(model, dev, prefetch=0, home="nvme" if swapper else "host", swapper=swapper)
        else:
            dev.place(model)
        blocks = find_blocks(model)
        forwards = [0] * len(blocks)
        for i, block in enumerate(blocks):  # a replayed forward calls the block's forward, not the block: count a part
            next(block.children()).register_forward_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
        Activations(blocks, policy, dev, min_numel=256)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0,
                          streamer=streamer)
        losses = []
        for step in range(steps):
            loss = loss_of(model, batch(family, step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        dev.synchronize()
        run = {"masters": [m.clone() for m in opt.master_weights()], "losses": losses, "forwards": forwards,
               "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, "trace": dev.trace,
               "streamer": streamer, "model": model}
        opt.close()
        return run


@pytest.fixture(scope="module", params=FAMILIES)
def kept(request):
    return request.param, _train(request.param)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_stack_is_found_in_the_model_and_in_its_base_model(family):
    model = tiny(family)
    assert find_blocks(model) == list(STACKS[family](model))
    assert find_blocks(model.base_model) == list(STACKS[family](model))


def test_a_model_without_a_known_stack_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="pass blocks="):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("streamed", [False, True], ids=["placed", "streamed"])
def test_every_policy_and_streaming_train_bit_for_bit_like_the_plain_model(kept, policy, streamed):
    family, reference = kept
    run = _train(family, policy, streamed)
    assert run["losses"] == reference["losses"]
    assert all(torch.equal(a, b) for a, b in zip(run["masters"], reference["masters"], strict=True))
    assert run["state"].keys() == reference["state"].keys()
    assert all(torch.equal(run["state"][k], reference["state"][k]) for k in reference["state"])
    # the policy did what it says: a replayed forward in every backward, or the saved tensors down and back
    runs_again = policy in ("recompute", "offload_input")
    assert run["forwards"] == [3 * (2 if runs_again else 1)] * len(run["forwards"])
    down = [s for s in run["trace"].spans if s.name.startswith("d2h activation")]
    up = [s for s in run["trace"].spans if s.name.startswith("h2d activation")]
    assert (len(down) > 0) == (policy in ("offload", "offload_input")) and len(up) == len(down)
    if streamed:
        # one block at a time came up for each use, and is away now (the assertions compare plain numbers: pytest's
        # report would print a released weight, which has no memory to print)
        blocks = run["streamer"].blocks
        fetches, peak, budget = run["streamer"].fetches, run["streamer"].peak_bytes, run["streamer"].budget_bytes
        assert fetches == 3 * 2 * len(blocks) and peak <= budget == max(b.nbytes for b in blocks), (fetches, peak)
        on_device = sum(p.untyped_storage().nbytes() for block in blocks for p in block.params)
        assert on_device == 0


def test_a_tied_embedding_stays_resident_while_the_blocks_stream():
    with device("sim") as dev:
        model = tiny("gpt2")
        streamer = ParamStreamer(model, dev)
        tied = model.transformer.wte.weight
        assert tied is model.lm_head.weight and any(p is tied for p in streamer.resident)
        assert not any(streamer.streams(p) for p in model.transformer.wte.parameters())
        assert all(streamer.streams(p) for p in model.transformer.h.parameters())


def test_llama_streams_from_nvme_bit_for_bit(tmp_path):
    reference = _train("llama", "offload")
    with Swapper(tmp_path) as swapper:
        run = _train("llama", "offload", streamed=True, swapper=swapper)
    assert all(torch.equal(a, b) for a, b in zip(run["masters"], reference["masters"], strict=True))


def test_selective_and_a_model_that_checkpoints_itself_are_refused():
    with device("sim") as dev:
        model = tiny("llama")
        dev.place(model)
        with pytest.raises(ValueError, match="use recompute"):
            Activations(find_blocks(model), "selective", dev)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        with pytest.raises(ValueError, match="checkpoints itself already"):
            Activations(find_blocks(model), "recompute", dev)
        assert all("forward" not in vars(block) for block in find_blocks(model))  # refused: nothing changed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_streamed_llama_with_offloaded_activations_trains_like_keep():
    """A Hugging Face Llama on a GPU that lags the host: weights streamed from pinned host memory and activations
    offloaded train like the plain model (to the GPU's reduction order)."""
    from helpers import keep_gpu_busy

    results = []
    for streamed in (False, True):
        with device("cuda") as dev:
            model = tiny("llama")
            streamer = ParamStreamer(model, dev, prefetch=1) if streamed else None
            if not streamed:
                dev.place(model)
            Activations(find_blocks(model), "offload" if streamed else "keep", dev, min_numel=256)
            opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0,
                              streamer=streamer)
            for step in range(3):
                inputs = {k: v.cuda() for k, v in batch("llama", step).items()}
                keep_gpu_busy()
                loss_of(model, inputs).backward()
                keep_gpu_busy()
                opt.step()
                opt.zero_grad()
            dev.synchronize()
            results.append([m.detach().cpu().clone() for m in opt.master_weights()])
            opt.close()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
