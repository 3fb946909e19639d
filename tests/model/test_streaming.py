"""ParamStreamer (model/streaming.py):
streamed training equals unstreamed training, within its budget, on the strict sim."""

import pytest
import torch
from helpers import keep_gpu_busy
from torch import nn

from minioffload.devices import device
from minioffload.devices.sim import SimDevice
from minioffload.engine.optimizer import OffloadAdam
from minioffload.model.activations import POLICIES, Activations
from minioffload.model.gpt import GPT, GPTConfig
from minioffload.model.streaming import ParamStreamer
from minioffload.nvme.swapper import Swapper

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=24, dropout=0.0)


def _model(cfg=CFG, dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(cfg).to(dtype)


def _batches(steps, cfg=CFG, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g) for _ in range(2))
            for _ in range(steps)]


def _train(dev, model, streamer=None, policy="keep", steps=3, swapper=None, opt=None, batches=None,
           evaluate=False):
    """Losses of `steps` OffloadAdam steps (an evaluation forward between steps with `evaluate`), and the optimizer."""
    Activations(model.blocks, policy, dev)
    opt = opt or OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0,
                             streamer=streamer, swapper=swapper)
    losses = []
    for x, y in batches or _batches(steps):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if evaluate:
            with torch.no_grad():
                model(x, y)
    dev.synchronize()
    return losses, opt


def _reference(dtype=torch.float32, steps=3, policy="keep"):
    with SimDevice(jitter=0.0) as dev:
        model = _model(dtype=dtype)
        dev.place(model)
        losses, opt = _train(dev, model, policy=policy, steps=steps)
        return losses, [m.clone() for m in opt.master_weights()]


def _same(run, reference):
    losses, masters = run
    return losses == reference[0] and all(torch.equal(a, b) for a, b in zip(masters, reference[1], strict=True))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_streamed_training_equals_unstreamed(prefetch, policy):
    reference = _reference(policy=policy)
    with SimDevice(jitter=2e-4, seed=prefetch) as dev:
        model = _model()
        streamer = ParamStreamer(model, dev, prefetch=prefetch)
        losses, opt = _train(dev, model, streamer, policy)
        assert _same((losses, opt.master_weights()), reference)
        assert streamer.peak_bytes <= streamer.budget_bytes
        assert streamer.order is not None and len(streamer.order) == 2 * CFG.n_layer  # a forward and a backward


def test_bf16_streamed_equals_unstreamed_and_keeps_one_rounded_copy():
    reference = _reference(torch.bfloat16)
    with SimDevice(jitter=2e-4, seed=3) as dev:
        model = _model(dtype=torch.bfloat16)
        streamer = ParamStreamer(model, dev, prefetch=2)
        losses, opt = _train(dev, model, streamer)
        assert _same((losses, opt.master_weights()), reference)
        p = model.blocks[0].mlp.fc.weight
        assert streamer.host_value(p).dtype == torch.bfloat16  # the rounded copy at home, apart from the master
        assert torch.equal(streamer.host_value(p), opt.packing.master(opt.packing.slots[p]).bfloat16())


def test_fp32_home_is_the_master_itself():
    with SimDevice() as dev:
        model = _model()
        streamer = ParamStreamer(model, dev, prefetch=1)
        opt = OffloadAdam(model.parameters(), dev, subgroup_numel=3000, streamer=streamer)
        p = model.blocks[1].attn.qkv.weight
        slot = opt.packing.slots[p]
        assert streamer.host_value(p).data_ptr() == opt.packing.master(slot).data_ptr()


def test_streamed_bytes_stay_within_budget_in_the_ledger():
    with SimDevice(jitter=1e-4, seed=5) as dev:
        model = _model()
        streamer = ParamStreamer(model, dev, prefetch=1)
        _train(dev, model, streamer, "recompute")
        held, peak = 0, 0
        for event in dev.ledger.history:
            if event.name.startswith("streamed "):
                held += event.delta
                peak = max(peak, held)
        block = streamer.blocks[0].nbytes
        assert peak <= streamer.budget_bytes == 2 * block
        assert peak == 2 * block  # prefetching did hold a second block


def test_weights_four_times_the_device_train_from_nvme_like_a_large_device(tmp_path):
    cfg = CFG.replace(n_layer=12, n_embd=48)
    with SimDevice() as big:
        model = _model(cfg)
        big.place(model)
        reference = _train(big, model, policy="recompute", batches=_batches(3, cfg))[0]
    model = _model(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = weights // 4
    (tmp_path / "w").mkdir()
    (tmp_path / "s").mkdir()
    with SimDevice(memory_bytes=capacity, jitter=1e-4, seed=7) as dev, \
            Swapper(tmp_path / "w", direct=False) as home, Swapper(tmp_path / "s", direct=False) as state:
        streamer = ParamStreamer(model, dev, prefetch=1, home="nvme", swapper=home)
        losses, _ = _train(dev, model, streamer, "recompute", swapper=state, batches=_batches(3, cfg))
        assert weights >= 4 * dev.ledger.capacity("device")
        assert dev.ledger.peak("device") <= capacity
        assert losses == reference


def test_a_backward_that_outruns_the_link_holds_one_blocks_gradients():
    """The planner counts one streamed block's gradients on the device (memory.streamed_bytes). Gradient copies far
    slower than backward must not pile more up there: the host waits for the oldest copies instead."""
    from minioffload.devices import Link

    def gradient_peak(d2h_bytes_per_s):
        with SimDevice(d2h=Link(d2h_bytes_per_s)) as dev:
            model = _model(CFG.replace(n_layer=6))
            streamer = ParamStreamer(model, dev, prefetch=1)
            _train(dev, model, streamer, steps=1)
            held = peak = 0
            for event in dev.ledger.history:
                if event.name.startswith("grad"):
                    held += event.delta
                    peak = max(peak, held)
            return peak, max(block.nbytes for block in streamer.blocks)

    peak, block = gradient_peak(2e5)  # a block's gradients take ~0.25 s to leave, its backward a few ms
    assert peak <= block + max(p.numel() * 4 for p in _model().parameters()), (peak, block)
    assert gradient_peak(2e9)[0] <= peak + block  # the bound is what a fast link gives anyway, give or take


def test_nvme_weights_resume_bit_for_bit(tmp_path):
    batches = _batches(4)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    with SimDevice(jitter=1e-4, seed=1) as dev, Swapper(tmp_path / "a", direct=False) as home:
        model = _model()
        straight = _train(dev, model, ParamStreamer(model, dev, prefetch=2, home="nvme", swapper=home),
                          batches=batches)[0]
    with SimDevice(jitter=1e-4, seed=2) as dev, Swapper(tmp_path / "b", direct=False) as home:
        model = _model()
        first, opt = _train(dev, model, ParamStreamer(model, dev, prefetch=2, home="nvme", swapper=home),
                            batches=batches[:2])
        checkpoint = opt.state_dict()
    with SimDevice(jitter=1e-4, seed=3) as dev, Swapper(tmp_path / "c", direct=False) as home:
        model = _model(CFG)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the resumed weights must come from the checkpoint, not the fresh model
        streamer = ParamStreamer(model, dev, prefetch=2, home="nvme", swapper=home)
        opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0,
                          streamer=streamer)
        opt.load_state_dict(checkpoint)
        rest = _train(dev, model, streamer, opt=opt, batches=batches[2:])[0]
    assert first + rest == straight


def test_an_evaluation_pass_between_steps_records_the_order_again_and_changes_nothing():
    reference = _reference()
    with SimDevice(jitter=1e-4, seed=4) as dev:
        model = _model()
        streamer = ParamStreamer(model, dev, prefetch=2)
        losses, opt = _train(dev, model, streamer, evaluate=True)
        assert streamer.reorders >= 1
        assert _same((losses, opt.master_weights()), reference)


def test_shared_and_outer_weights_stay_resident():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
            self.blocks[2].weight = self.blocks[0].weight  # shared by two blocks
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    with SimDevice() as dev:
        model = Shared()
        expected = model(torch.ones(2, 8)).detach()
        streamer = ParamStreamer(model, dev, prefetch=1)
        shared = model.blocks[0].weight
        assert any(p is shared for p in streamer.resident) and not streamer.streams(shared)
        assert streamer.streams(model.blocks[1].weight) and not streamer.streams(model.head.weight)
        assert dev.is_device(shared) and not dev.is_device(model.blocks[1].weight)
        assert torch.equal(model(torch.ones(2, 8)), expected)
        streamer.remove()
        assert dev.is_device(model.blocks[1].weight) and torch.equal(model(torch.ones(2, 8)), expected)


def _storages(model):
    return [p.untyped_storage().nbytes() for p in model.parameters()]


@pytest.mark.parametrize("kwargs, words", [
    ({"prefetch": -1}, "prefetch must be an int >= 0"),
    ({"prefetch": 1, "budget_bytes": 1000}, "smaller than a block and its prefetch: blocks"),
    ({"home": "disk"}, "home must be one of"),
    ({"home": "nvme"}, "needs swapper="),
])
def test_bad_settings_are_refused_before_anything_moves(kwargs, words):
    with SimDevice() as dev:
        model = _model()
        before = _storages(model)
        with pytest.raises(ValueError, match=words):
            ParamStreamer(model, dev, **kwargs)
        assert _storages(model) == before and dev.ledger.used("device") == 0


def test_the_budget_error_names_the_numbers():
    with SimDevice() as dev:
        model = _model()
        block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        with pytest.raises(ValueError) as err:
            ParamStreamer(model, dev, prefetch=2, budget_bytes=3 * block - 1)
        assert f"{3 * block - 1:,}" in str(err.value) and f"{3 * block:,}" in str(err.value)
        assert "prefetch=2" in str(err.value)


def test_a_model_without_blocks_and_a_device_too_small_are_refused():
    with SimDevice() as dev:
        with pytest.raises(ValueError, match="cannot find the blocks of Linear"):
            ParamStreamer(nn.Linear(4, 4), dev)
    with SimDevice(memory_bytes=10_000) as dev:
        model = _model()
        before = _storages(model)
        with pytest.raises(ValueError, match="the device has .* free"):
            ParamStreamer(model, dev)
        assert _storages(model) == before


def test_streaming_refuses_delayed_and_hybrid_updates():
    with SimDevice() as dev:
        model = _model()
        streamer = ParamStreamer(model, dev)
        for option in ({"delay_updates_after": 1}, {"gpu_fraction": 0.5}):
            with pytest.raises(ValueError, match="streamed weights .* take the synchronous CPU update only"):
                OffloadAdam(model.parameters(), dev, streamer=streamer, **option)


@pytest.mark.parametrize("budget_blocks", [2, 3])
def test_nvme_bounce_buffers_follow_the_budget_and_the_hooks_never_wait_for_a_copy(tmp_path, monkeypatch,
                                                                                     budget_blocks):
    """One bounce buffer per block the budget holds; a buffer comes back once its copy up has landed, asked, not
    waited for, so a hook never stops the host's run-ahead while a free buffer is left."""
    from minioffload.devices.sim_streams import SimEvent

    with SimDevice(jitter=1e-4, seed=4) as dev, Swapper(tmp_path, direct=False) as home:
        model = _model()
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        streamer = ParamStreamer(model, dev, prefetch=1, home="nvme", swapper=home, budget_bytes=budget_blocks * block)
        assert len(streamer._bounces) == budget_blocks
        waits = []
        real = SimEvent.synchronize

        def counted(event, *args, **kwargs):
            # a host wait for work not known to be done (query() not asked first, or said no). On the sim the copy has
            # landed anyway, since compute's own wait blocks the host here (compute runs on it), so it is the call
            # that is counted: on a GPU the same call would stop the host until the copy lands
            # (the gradient path's bound on device gradients in flight, engine/gradients.py, is another wait: for
            # device memory, on a gradient's copy down, not on a fetch)
            gradient_copy = any(event is pending for pending, _ in opt.grads._in_flight)
            if not asked.pop(id(event), False) and not gradient_copy:
                waits.append(event)
            return real(event, *args, **kwargs)

        asked = {}
        real_query = SimEvent.query

        def query(event):
            done = real_query(event)
            asked[id(event)] = done
            return done

        monkeypatch.setattr(SimEvent, "query", query)

        opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0, streamer=streamer)
        losses = []
        for x, y in _batches(3):
            monkeypatch.setattr(SimEvent, "synchronize", counted)  # forward and backward: the hooks
            _, loss = model(x, y)
            loss.backward()
            monkeypatch.setattr(SimEvent, "synchronize", real)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        dev.synchronize()
        assert not waits
    assert losses == _reference(steps=3)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("home", ["host", "nvme"])
def test_on_cuda_streaming_trains_like_resident_weights_with_a_lagging_gpu(home, tmp_path):
    """The GPU kept busy so the host runs ahead: a block copied up into memory a queued kernel still uses, or used
    before its copy landed, or a bounce buffer reused under a copy, changes the losses and the weights."""
    def run(streamed):
        model = _model().cuda()
        with device("cuda") as dev, Swapper(tmp_path / f"{home}{streamed}", direct=False) as swapper:
            if streamed:
                streamer = ParamStreamer(model, dev, prefetch=1, home=home,
                                         swapper=swapper if home == "nvme" else None)
            else:
                streamer = dev.place(model) and None
            opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=3000, max_grad_norm=1.0,
                              streamer=streamer)
            losses = []
            for x, y in _batches(4):
                keep_gpu_busy()
                _, loss = model(x.cuda(), y.cuda())
                loss.backward()
                keep_gpu_busy()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            dev.synchronize()
            return torch.stack(losses).cpu(), [m.clone() for m in opt.master_weights()]

    (tmp_path / f"{home}True").mkdir()
    (tmp_path / f"{home}False").mkdir()
    resident, streamed = run(False), run(True)
    torch.testing.assert_close(streamed[0], resident[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(streamed[1], resident[1], strict=True):  # embedding backward sums in any order on a GPU
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("home, dtype", [("host", torch.float32), ("host", torch.bfloat16), ("nvme", torch.float32)])
def test_a_streamed_models_state_dict_saves_and_loads_its_weights(home, dtype, tmp_path):
    """Released blocks have no device memory: state_dict gives each weight from home (as a resident model's would),
    torch.save writes a file that loads, and load_state_dict writes the weights home."""
    with SimDevice(jitter=0.0) as dev:
        resident = _model(dtype=dtype)
        dev.place(resident)
        _train(dev, resident, steps=2)
        want = {k: v.clone() for k, v in resident.state_dict().items()}

    (tmp_path / "nvme").mkdir()
    with SimDevice(jitter=0.0) as dev, Swapper(tmp_path / "nvme", direct=False) as swapper:
        model = _model(dtype=dtype)
        streamer = ParamStreamer(model, dev, prefetch=1, home=home, swapper=swapper if home == "nvme" else None)
        _train(dev, model, streamer, steps=2)
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k].cpu(), want[k]) for k in want)
        torch.save(got, tmp_path / "weights.pt")
        fresh = _model(dtype=dtype)
        fresh.load_state_dict(torch.load(tmp_path / "weights.pt"))
        assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())

        # new weights into the streamed model: they go home, and its forward uses them
        scrambled = {k: v + 1 for k, v in want.items()}
        assert model.load_state_dict(scrambled).missing_keys == []
        assert all(torch.equal(model.state_dict()[k].cpu(), scrambled[k]) for k in want)
        fresh.load_state_dict(scrambled)
        x, y = _batches(1)[0]
        with torch.no_grad():
            assert torch.equal(model(x, y)[1], fresh(x, y)[1])
        streamer.remove()
