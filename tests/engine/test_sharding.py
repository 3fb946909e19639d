"""Sharded offload (engine/sharding.py, OffloadAdam(shard=)) on 2 gloo ranks spawned from the test, each with
its own sim.

N ranks training on micro-batches r of each step must give the weights of one process accumulating those N
micro-batches: bitwise for fp32 (the engine sums two ranks' gradients, scales by a power of two, and adds the
norm's partial sums in subgroup order, as one process does)."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import HYPER, Toy, batch, loss_of, on_sim, train
from ranks import run_ranks

from minioffload.devices import device
from minioffload.engine.optimizer import OffloadAdam
from minioffload.engine.sharding import Shard, WeightGather
from minioffload.layout import shard_owners
from minioffload.model.gpt import GPT, GPTConfig
from minioffload.model.streaming import ParamStreamer
from minioffload.nvme.swapper import Swapper
from minioffload.options import OffloadOptions
from minioffload.train.loop import TrainConfig, checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    """Every process of these tests runs torch on one thread, as each rank does (ranks.py): torch's CPU kernels
    (an embedding's backward among them) add in an order that depends on the thread count, and bit-for-bit
    comparisons need the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(dev, shard=None, swapper=None, dtype=torch.float32, **options):
    torch.manual_seed(0)
    model = on_sim(Toy().to(dtype), dev)
    settings = {**HYPER, "subgroup_numel": 300, "max_grad_norm": 0.5, **options}
    return model, OffloadAdam(model.parameters(), dev, shard=shard, swapper=swapper, **settings)


def steps_on_rank(model, opt, rank, first, last):
    for step in range(first, last):
        opt.scale_loss(loss_of(model, *batch(100 * step + rank))).backward()
        opt.step()
        opt.zero_grad()


def swapper_in(root, name):
    if not root:
        return None
    (Path(root) / name).mkdir(parents=True, exist_ok=True)
    return Swapper(Path(root) / name)


def sharded_run(rank, world, steps, nvme_root=None, dtype=torch.float32, options=None):
    swapper = swapper_in(nvme_root, f"rank{rank}")
    with device("sim", jitter=2e-4, seed=rank) as dev:
        model, opt = make(dev, Shard(timeout_s=60), swapper, dtype, **(options or {}))
        steps_on_rank(model, opt, rank, 0, steps)
        dev.synchronize()
        d2h = sum(s.nbytes for s in dev.trace.spans if s.lane == "d2h")
        owned = sum(sub.numel for sub in opt.subgroups if sub.owner == rank)
        masters = [m.clone() for m in opt.master_weights()]
        return {"masters": masters, "params": [p.detach().clone() for p in model.parameters()],
                "d2h": d2h, "owned": owned, "host": sum(t.numel() for sub in opt.subgroups
                                                         for t in sub.held().values())}


def one_process(steps, world=2, nvme_root=None, dtype=torch.float32, options=None):
    swapper = swapper_in(nvme_root, "one")
    with device("sim") as dev:
        model, opt = make(dev, swapper=swapper, dtype=dtype, **(options or {}))
        for step in range(steps):  # micro-batch m of step s: batch(100 * s + m)
            for micro in range(world):
                opt.scale_loss(loss_of(model, *batch(100 * step + micro)) / world).backward()
            opt.step()
            opt.zero_grad()
        dev.synchronize()
        return [m.clone() for m in opt.master_weights()], [p.detach().clone() for p in model.parameters()]


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": None}, {"loss_scale": "dynamic", "min_offload_numel": 20}])
def test_two_ranks_give_one_process_weights_bit_for_bit(options):
    out = run_ranks(sharded_run, 2, 3, None, torch.float32, options)
    masters, params = one_process(3, options=options)
    for rank in range(2):
        assert equal(out[rank]["masters"], masters), f"rank {rank}'s masters differ from one process's"
        assert equal(out[rank]["params"], params), f"rank {rank}'s weights differ from one process's"


def test_each_rank_moves_and_holds_only_its_own_subgroups():
    out = run_ranks(sharded_run, 2, 2)
    total = out[0]["owned"] + out[1]["owned"]
    for rank in range(2):  # 2 steps of fp32 gradients, of its own subgroups only; state for those only
        assert out[rank]["d2h"] == 2 * 4 * out[rank]["owned"]
        assert out[rank]["host"] == 5 * out[rank]["owned"]  # master, 2 moments, gradient, staging
    assert 0 < out[0]["owned"] < total and 0 < out[1]["owned"] < total


def test_the_nvme_tier_sharded_gives_one_process_weights(tmp_path):
    out = run_ranks(sharded_run, 2, 3, str(tmp_path))
    masters, params = one_process(3, nvme_root=str(tmp_path))
    for rank in range(2):
        assert equal(out[rank]["masters"], masters) and equal(out[rank]["params"], params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "rank0", "rank1"]


def test_bf16_weights_agree_within_rounding():
    """bf16 gradients are summed in bf16 by the collective (one process sums them in fp32 on the host): close,
    not bitwise."""
    out = run_ranks(sharded_run, 2, 3, None, torch.bfloat16)
    masters, _ = one_process(3, dtype=torch.bfloat16)
    for got, want in zip(out[0]["masters"], masters, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    assert equal(out[0]["params"], out[1]["params"])  # every rank holds the same weights


# every rank reduces in one order, whatever order its gradients complete in ----------------------------------
class RecordingShard:
    """A Shard of rank 0 of 2 that owns no subgroup and records the reduces it is asked for (no other rank)."""

    rank, world = 0, 2

    def __init__(self):
        self.reduced: list[int] = []

    def check_same(self, settings):
        pass

    def assign(self, sizes):
        self.owners = [1] * len(sizes)
        return self.owners

    def reduce(self, flat, index):
        self.reduced.append(index)

    def gather_ints(self, values, what):
        return [values, values]  # both ranks alike


class Chain(torch.nn.Module):
    """Square layers applied in any order, or some not at all: the order their gradients complete in follows."""

    def __init__(self, layers=4, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x, order):
        for k in order:
            x = torch.tanh(self.layers[k](x))
        return x.sum()


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [0, 1, 3]],
                         ids=["forward", "reversed", "shuffled", "one unused"])
def test_reduces_go_last_subgroup_first_whatever_order_gradients_complete_in(sim, order):
    torch.manual_seed(0)
    model = sim.place(Chain())
    shard = RecordingShard()
    OffloadAdam(model.parameters(), sim, shard=shard, subgroup_numel=64, **HYPER)  # one layer per subgroup
    for _ in range(2):  # two micro-batches: each backward reduces every subgroup once
        model(torch.randn(3, 8), order).backward()
    assert shard.reduced == [3, 2, 1, 0, 3, 2, 1, 0]


class NoGradientFor(torch.autograd.Function):
    """Passes x on and gives `weight` an undefined gradient: autograd reaches its accumulation (its hook runs) but
    sets no gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("a failure midway through backward")


def test_a_parameter_reached_with_no_gradient_takes_its_turn_with_zeros(sim):
    torch.manual_seed(0)
    model = sim.place(Chain())
    shard = RecordingShard()
    opt = OffloadAdam(model.parameters(), sim, shard=shard, subgroup_numel=64, **HYPER)
    x = torch.tanh(model.layers[0](torch.randn(3, 8)))
    model(NoGradientFor.apply(x, model.layers[1].weight), [2, 3]).backward()
    assert shard.reduced == [3, 2, 1, 0]
    opt.sharded.reduce_the_rest(opt.kept)
    assert [slot.has_grad for slot in opt.packing.slots.values()] == [True, False, True, True]


def test_subgroups_left_waiting_by_a_failed_backward_are_reduced_in_turn_before_the_next(sim):
    torch.manual_seed(0)
    model = sim.place(Chain())
    shard = RecordingShard()
    opt = OffloadAdam(model.parameters(), sim, shard=shard, subgroup_numel=64, **HYPER)
    x = torch.tanh(model.layers[1](torch.tanh(model.layers[0](torch.randn(3, 8)))))
    with pytest.raises(ValueError, match="midway"):
        model(FailsInBackward.apply(x), [2, 3]).backward()
    assert shard.reduced == [3, 2]  # subgroups 1 and 0 wait for gradients that never come
    model(torch.randn(3, 8), [3, 2, 1, 0]).backward()  # its first gradient is for a subgroup still waiting
    opt.sharded.reduce_the_rest(opt.kept)
    assert shard.reduced == [3, 2, 1, 0, 3, 2, 1, 0]
    assert all(slot.has_grad for slot in opt.packing.slots.values())


def side_on_rank_zero(rank, world, steps, options):
    """Rank 0's batches use Toy's side branch, rank 1's never: its gradients complete in another order, and some
    parameters get a gradient on rank 0 only."""
    with device("sim", jitter=2e-4, seed=rank) as dev:
        model, opt = make(dev, Shard(timeout_s=20), **options)
        for step in range(steps):
            opt.scale_loss(loss_of(model, *batch(100 * step + rank), use_side=rank == 0)).backward()
            opt.step()
            opt.zero_grad()
        dev.synchronize()
        return {"masters": [m.clone() for m in opt.master_weights()],
                "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("options", [{}, {"min_offload_numel": 20}])  # 20: side.bias stays on the device
def test_a_parameter_unused_on_one_rank_trains_as_in_one_process(options):
    out = run_ranks(side_on_rank_zero, 2, 2, options, timeout_s=20)  # out of step, the ranks would time out
    with device("sim") as dev:
        model, opt = make(dev, **options)
        for step in range(2):
            for micro in range(2):
                opt.scale_loss(loss_of(model, *batch(100 * step + micro), use_side=micro == 0) / 2).backward()
            opt.step()
            opt.zero_grad()
        masters, params = opt.master_weights(), [p.detach().clone() for p in model.parameters()]
    for rank in range(2):
        assert equal(out[rank]["masters"], masters), f"rank {rank}'s masters differ from one process's"
        assert equal(out[rank]["params"], params), f"rank {rank}'s weights differ from one process's"


# NCCL broadcasts: the host does not poll them ----------------------------------------------------------------
class FakeWork:
    def __init__(self):
        self.waits: list[tuple] = []

    def wait(self, *timeout) -> bool:
        self.waits.append(timeout)
        return True


@pytest.mark.parametrize("backend, device_wait", [("nccl", ()), ("gloo", (timedelta(seconds=7),))])
def test_device_broadcasts_on_nccl_are_waited_for_without_a_timeout(sim, monkeypatch, backend, device_wait):
    """work.wait(timeout) on NCCL makes the host poll until the collective ends; work.wait() only makes the stream
    wait. gloo (and the host group) keep the timeout: there the wait is where a failure is raised."""
    works: list[FakeWork] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: works.append(FakeWork()) or works[-1])
    shard = Shard.__new__(Shard)  # without a process group
    shard.rank, shard.world, shard.owners, shard.backend = 0, 2, [1, 1], backend
    shard.group = shard.host_group = torch.distributed.group.WORLD
    shard.timeout, shard.net_bytes = timedelta(seconds=7), 0
    written = []
    gather = WeightGather(shard, sim, lambda slots, flat: written.append(slots), in_flight=4)
    gather.receive(0, 8, torch.float32, "on the device")
    gather.receive(1, 8, torch.float32, "at home", on_host=True)
    gather.finish()
    assert [work.waits for work in works] == [[device_wait], [(timedelta(seconds=7),)]]
    assert written == ["on the device", "at home"]


# streamed weights: every rank keeps the whole weights at home; the optimizer is sharded ----------------------
def gpt_batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 17, (4, 16), generator=g), torch.randint(0, 17, (4, 16), generator=g)


def streamed_gpt(dev, shard, home, root, name):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", 17, block_size=16))
    streamer = ParamStreamer(model, dev, prefetch=1, home=home, swapper=swapper_in(root if home == "nvme" else None,
                                                                                   name))
    return model, OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=5000, max_grad_norm=0.5, shard=shard,
                              streamer=streamer)


def streamed_on_ranks(rank, world, steps, home, root):
    with device("sim", jitter=2e-4, seed=rank) as dev:
        model, opt = streamed_gpt(dev, Shard(timeout_s=60), home, root, f"rank{rank}")
        for step in range(steps):
            model(*gpt_batch(step, rank))[1].backward()
            opt.step()
            opt.zero_grad()
        dev.synchronize()
        weights = {name: p.detach().clone() for name, p in model.named_parameters() if not opt.streamer.streams(p)}
        homes = [opt.streamer.host_value(p).clone() for p in model.parameters() if opt.streamer.streams(p)]
        return {"masters": [m.clone() for m in opt.master_weights()], "resident": weights, "homes": homes}


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_streamed_weights_with_a_sharded_optimizer_train_like_one_process(home, tmp_path):
    """Close, not bitwise: this CPU's matrix products round differently with the blocks' storage at other addresses
    (chapter 8 measured it), and two processes place them differently. Every rank's homes hold the same weights."""
    out = run_ranks(streamed_on_ranks, 2, 3, home, str(tmp_path))
    with device("sim") as dev:
        model, opt = streamed_gpt(dev, None, home, str(tmp_path), "one")
        for step in range(3):
            for micro in range(2):
                (model(*gpt_batch(step, micro))[1] / 2).backward()
            opt.step()
            opt.zero_grad()
        masters = opt.master_weights()
    for got, want in zip(out[0]["masters"], masters, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert equal(out[0]["masters"], out[1]["masters"]) and equal(out[0]["homes"], out[1]["homes"])
    assert all(torch.equal(out[0]["resident"][k], out[1]["resident"][k]) for k in out[0]["resident"])
    streamed_masters = [m for m, p in zip(out[0]["masters"], model.parameters(), strict=True)
                        if opt.streamer.streams(p)]
    assert equal(out[0]["homes"], streamed_masters)  # fp32: each home holds the master exactly


def test_shard_owners_balance_and_agree():
    assert shard_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert shard_owners([10, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    sizes = [int(x) for x in torch.randint(1, 100, (40,), generator=torch.Generator().manual_seed(1))]
    for ranks in (1, 2, 3, 8):
        owners = shard_owners(sizes, ranks)
        load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(ranks)]
        assert max(load) - min(load) <= max(sizes)
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        shard_owners([1], 0)


# checkpoints: saved on some ranks, loaded on others ------------------------------------------------
def save_on_ranks(rank, world, path, steps):
    with device("sim") as dev:
        model, opt = make(dev, Shard(timeout_s=60))
        steps_on_rank(model, opt, rank, 0, steps)
        checkpoint.save(path, model, opt, extra={"step": steps})
        return True


def load_on_ranks(rank, world, path, first, last):
    with device("sim") as dev:
        model, opt = make(dev, Shard(timeout_s=60))
        extra = checkpoint.load(path, model, opt)
        steps_on_rank(model, opt, rank, first, last)
        return {"extra": extra, "masters": [m.clone() for m in opt.master_weights()]}


def test_a_checkpoint_saved_on_two_ranks_continues_on_one_bit_for_bit(tmp_path):
    run_ranks(save_on_ranks, 2, str(tmp_path / "ck"), 2)
    straight, _ = one_process(4)
    with device("sim") as dev:
        model, opt = make(dev)
        assert checkpoint.load(tmp_path / "ck", model, opt) == {"step": 2}
        for step in range(2, 4):
            for micro in range(2):
                (loss_of(model, *batch(100 * step + micro)) / 2).backward()
            opt.step()
            opt.zero_grad()
        assert equal(opt.master_weights(), straight)
    exported = checkpoint.load_exported(checkpoint.export(tmp_path / "ck", tmp_path / "one.pt"))
    assert sorted(exported["optimizer"]["state"]) == list(range(len(straight)))


def test_a_checkpoint_saved_by_one_process_continues_on_two_ranks(tmp_path):
    with device("sim") as dev:
        model, opt = make(dev)
        train(model, opt, 2, micro_batches=2)
        checkpoint.save(tmp_path / "ck", model, opt, extra={"step": 2})
    out = run_ranks(load_on_ranks, 2, str(tmp_path / "ck"), 2, 4)
    straight, _ = one_process(4)
    assert out[0]["extra"] == {"step": 2} and equal(out[0]["masters"], straight) and equal(out[1]["masters"], straight)


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    with device("sim") as dev:
        model, opt = make(dev)
        train(model, opt, 1)
        checkpoint.save(tmp_path / "ck", model, opt)
        torch.manual_seed(1)
        other = on_sim(Toy(width=8), dev)
        other_opt = OffloadAdam(other.parameters(), dev, subgroup_numel=300, **HYPER)
        before = [p.detach().clone() for p in other.parameters()]
        with pytest.raises(ValueError, match="does not match this model"):
            checkpoint.load(tmp_path / "ck", other, other_opt)
        assert equal(before, list(other.parameters()))
        with pytest.raises(ValueError, match="holds no checkpoint"):
            checkpoint.load(tmp_path / "nothing", model, opt)


# bad input: every rank gets an error naming the rank and the setting; none hangs -------------------------
def mismatched(rank, world):
    with device("sim") as dev:
        torch.manual_seed(0)
        model = on_sim(Toy(), dev)
        OffloadAdam(model.parameters(), dev, subgroup_numel=300, shard=Shard(timeout_s=20),
                    **{**HYPER, "lr": 1e-2 if rank == 0 else 2e-2})


def too_many_ranks(rank, world):
    with device("sim") as dev:
        torch.manual_seed(0)
        model = on_sim(Toy(), dev)
        OffloadAdam(model.parameters(), dev, subgroup_numel=10**6, shard=Shard(timeout_s=20), **HYPER)


def one_rank_dies(rank, world):
    with device("sim") as dev:
        model, opt = make(dev, Shard(timeout_s=10))
        if rank == 1:
            os._exit(0)  # gone without a word, mid-run
        steps_on_rank(model, opt, rank, 0, 1)


def test_mismatched_settings_are_named_on_every_rank():
    results = run_ranks(mismatched, 2, expect_errors=True)
    for res in results:
        assert "rank 1 has param_groups=" in res["error"] and "same settings" in res["error"], res


def test_more_ranks_than_subgroups_is_refused_on_every_rank():
    results = run_ranks(too_many_ranks, 2, expect_errors=True)
    for res in results:
        assert "cannot be shared by 2 ranks" in res["error"] and "lower subgroup_numel" in res["error"], res


def test_a_rank_that_dies_becomes_an_error_not_a_hang():
    alive, dead = run_ranks(one_rank_dies, 2, timeout_s=10, expect_errors=True)
    assert dead["error"] == "rank 1 exited without a result"
    assert alive["error"].startswith("RuntimeError: rank 0 of 2: the reduce of subgroup") and \
        "Another rank died" in alive["error"], alive  # its collective timed out (10 s): an error, not a hang


def test_sharded_options_are_refused_clearly():
    with pytest.raises(ValueError, match="shard needs torchrun's environment"):
        from minioffload.train.loop import _join
        env = {k: v for k, v in os.environ.items()}
        os.environ.pop("WORLD_SIZE", None)
        try:
            _join(TrainConfig(device="sim", shard=True))
        finally:
            os.environ.clear()
            os.environ.update(env)
    with pytest.raises(ValueError, match="sharding the optimizer state, ranks=.* .train: shard., needs the offloaded"):
        TrainConfig(device="sim", shard=True, offload=False)
    with pytest.raises(ValueError, match="ranks=.* .train: shard., runs the synchronous CPU update"):
        TrainConfig(device="sim", shard=True, optimizer=OffloadOptions(gpu_fraction=0.5))
    with device("sim") as dev:
        with pytest.raises(ValueError, match="leave delay_updates_after, gpu_fraction, stride and speculative off"):
            OffloadAdam(on_sim(Toy(), dev).parameters(), dev, shard=SimpleNamespace(world=2), stride=2)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        Shard()


# the CLI under torchrun -----------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_ranks_train_like_one_process_accumulating(tmp_path):
    common = ["--device", "sim", "--steps", "3", "--model", "tiny", "--batch-size", "4", "--block-size", "32",
              "--no-progress", "--eval-every", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "minioffload", "train", "--shard", *common, "--out-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "minioffload", "train", "--grad-accum", "2", *common,
                          "--out-dir", str(tmp_path / "one")], capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = [[line.split(",")[1] for line in (tmp_path / run / "loss.csv").read_text().splitlines()[1:]]
              for run in ("two", "one")]
    assert losses[0] == losses[1]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["ranks"] == 2 and (tmp_path / "two" / "trace_rank1.json").is_file()
    links = [rank["link_bytes_per_step"] for rank in summary["per_rank"]]
    one_link = json.loads((tmp_path / "one" / "summary.json").read_text())["per_rank"][0]["link_bytes_per_step"]
    assert max(links) < 0.75 * one_link  # each rank moves about half the bytes one process moves
