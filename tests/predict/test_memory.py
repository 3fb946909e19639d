"""Byte accounting: the footprint table, the activation formula, and the Ledger."""

import threading
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minioffload.predict import memory
from minioffload.predict.memory import GB, GiB, Ledger, OutOfMemoryError, footprint

# (precision, optimizer, placement) -> bytes per param on (device, host, nvme), worked out by hand.
EXPECTED = {
    ("mixed_bf16", "adam", "device"): (16, 0, 0),  # 2 + 2 + 4 + 4 + 4, ZeRO's figure
    ("mixed_fp16", "adamw", "device"): (16, 0, 0),
    # offloaded: the engine's gradient path, 4 B fp32 accumulation + staging in the model's dtype
    ("mixed_bf16", "adam", "optimizer_cpu"): (2, 18, 0),  # ZeRO-Offload: 2 B/param on the GPU
    ("mixed_bf16", "adam", "optimizer_nvme"): (2, 6, 24),  # state and its previous version on disk
    ("mixed_bf16", "adam", "params_cpu"): (0, 20, 0),
    ("mixed_bf16", "adam", "params_nvme"): (0, 6, 26),  # ZeRO-Infinity: weights too on disk
    ("fp32", "adam", "device"): (16, 0, 0),  # 4 + 4 + 4 + 4, no master copy
    ("fp32", "adam", "optimizer_cpu"): (4, 20, 0),  # the host needs its own fp32 copy to update
    ("fp32", "sgd_momentum", "device"): (12, 0, 0),
    ("bf16", "adam", "device"): (8, 0, 0),
    ("bf16", "sgd_momentum", "optimizer_cpu"): (2, 10, 0),
    ("mixed_fp16", "sgd_momentum", "device"): (12, 0, 0),
}


@pytest.mark.parametrize("setup", EXPECTED)
def test_footprint_matches_the_hand_worked_table(setup):
    fp = footprint(*setup)
    assert tuple(fp.by_tier().values()) == EXPECTED[setup]
    assert fp.per_param() == sum(EXPECTED[setup])


def test_mixed_precision_adam_is_sixteen_bytes_in_zero_order():
    fp = footprint("mixed_fp16", "adam", "device")
    assert [(p.name, p.bytes_per_param) for p in fp.parts] == [
        ("weights", 2), ("grads", 2), ("master", 4), ("exp_avg", 4), ("exp_avg_sq", 4)]
    assert fp.bytes(7e9) == 112 * GB
    assert "total       device        16" in fp.table()


def test_offloading_adds_one_master_copy_and_the_engines_gradient_path():
    for precision in memory.PRECISIONS:
        for optimizer in memory.OPTIMIZERS:
            on_device = footprint(precision, optimizer, "device").per_param()
            model_b, master_b = memory._MODEL_BYTES[precision], memory._MASTER_BYTES[precision]
            # fp32 gradient buffer + staging replace the device's gradient; a master copy when none was needed
            grads = 4  # an fp32 buffer and a staging buffer (model_b) replace the device gradient (model_b)
            fp = footprint(precision, optimizer, "optimizer_cpu")
            assert fp.per_param() - on_device in (grads, grads + master_b), (precision, optimizer)
            assert footprint(precision, optimizer, "optimizer_cpu", delay=True).per_param() == fp.per_param() + model_b


def test_the_delayed_update_is_refused_where_the_engine_refuses_it():
    with pytest.raises(ValueError, match="optimizer_cpu"):
        footprint("mixed_bf16", "adam", "optimizer_nvme", delay=True)


def test_a_70b_model_fits_one_80gb_gpu_with_512gb_of_host_memory_and_nvme():
    assert memory.first_placement_that_fits(70e9, 80 * GB, host_bytes=512 * GB) == "params_nvme"


def test_footprint_matches_what_torch_adam_allocates():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    num_params = sum(p.numel() for p in model.parameters())
    weights_and_grads = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    # optimizer.state holds exp_avg and exp_avg_sq per parameter, plus a scalar `step` we do not count.
    state = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    assert weights_and_grads + state == footprint("fp32", "adam", "device").bytes(num_params)


@pytest.mark.parametrize("bad", [
    dict(precision="fp8"), dict(optimizer="lion"), dict(placement="gpu"), dict(precision="FP32"),
])
def test_unknown_names_are_refused_with_the_allowed_values(bad):
    with pytest.raises(ValueError, match="choose one of"):
        footprint(**bad)


@pytest.mark.parametrize("num_params", [0, -5, float("nan")])
def test_non_positive_sizes_are_refused(num_params):
    with pytest.raises(ValueError, match="num_params must be a positive number"):
        footprint().bytes(num_params)
    with pytest.raises(ValueError, match="positive"):
        memory.max_params_that_fit(num_params, footprint())


def test_max_params_and_first_placement():
    assert memory.max_params_that_fit(80 * GB, footprint()) == 5e9
    assert memory.max_params_that_fit(80 * GB, footprint(placement="params_cpu")) == float("inf")
    assert memory.first_placement_that_fits(1e9, 80 * GB) == "device"
    assert memory.first_placement_that_fits(13e9, 80 * GB) == "optimizer_cpu"
    assert memory.first_placement_that_fits(13e9, 80 * GB, host_bytes=100 * GB) == "optimizer_nvme"
    assert memory.first_placement_that_fits(175e9, 141 * GB) == "params_cpu"
    assert memory.first_placement_that_fits(175e9, 141 * GB, host_bytes=512 * GB) is None


def test_activation_formula_of_korthikanti_et_al():
    s, b, h, a = 2048, 4, 4096, 32
    assert memory.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert memory.activation_bytes_per_layer(s, b, h, a, flash_attention=True) == 34 * s * b * h
    assert memory.activation_bytes_per_layer(s, b, h, a, checkpointing=True) == 2 * s * b * h


@pytest.mark.parametrize("args", [(0, 1, 64, 1), (8, -1, 64, 1), (8, 1, 64.0, 1), (8, 1, 64, 5)])
def test_activation_bad_shapes_are_refused(args):
    with pytest.raises(ValueError, match="positive integer|divisible"):
        memory.activation_bytes_per_layer(*args)


# --- streamed parameters (chapter 8) ---------------------------------------------------------------

LAYERS, RESIDENT, NUM = 8, 1_000_000, 81_000_000  # eight blocks of 10M parameters


def test_streamed_device_bytes_grow_by_exactly_one_block_per_prefetch_depth():
    for precision, model_b in (("mixed_bf16", 2), ("fp32", 4)):
        sizes = [memory.streamed_bytes(NUM, LAYERS, RESIDENT, "host", k, precision)["device"] for k in range(4)]
        assert [b - a for a, b in pairwise(sizes)] == [10_000_000 * model_b] * 3
        # resident weights, the window of k + 1 blocks, one block's gradients
        assert sizes[2] == RESIDENT * model_b + (3 + 1) * 10_000_000 * model_b
    with_acts = memory.streamed_bytes(NUM, LAYERS, RESIDENT, "host", 2, activations=12345)["device"]
    assert with_acts == memory.streamed_bytes(NUM, LAYERS, RESIDENT, "host", 2)["device"] + 12345


def test_streamed_host_and_nvme_bytes_add_the_home_to_the_offloaded_optimizer():
    host = memory.streamed_bytes(NUM, LAYERS, RESIDENT, "host")
    assert host["host"] == NUM * 18 + (NUM - RESIDENT) * 2 and host["nvme"] == 0  # 18 B/param + the bf16 home
    on_nvme = memory.streamed_bytes(NUM, LAYERS, RESIDENT, "nvme")
    # the home on NVMe; the host keeps the bounce buffers fetches read into, one per block of the window, and the
    # two that new weights are written home from
    assert on_nvme["host"] == NUM * 18 + (2 + 2) * 10_000_000 * 2 and on_nvme["nvme"] == (NUM - RESIDENT) * 2
    # fp32: the master is the home, nothing more on the host
    assert memory.streamed_bytes(NUM, LAYERS, RESIDENT, "host", precision="fp32")["host"] == NUM * 20
    # the optimizer on NVMe too: the host keeps the gradients and the tier's three working sets
    both = memory.streamed_bytes(NUM, LAYERS, RESIDENT, "nvme", nvme=True, subgroup_numel=1 << 20)
    assert both["host"] == NUM * 6 + 3 * 12 * (1 << 20) + (2 + 2) * 10_000_000 * 2
    assert both["nvme"] == NUM * 24 + (NUM - RESIDENT) * 2
    # the gradients there too: no gradient per parameter on the host, three sets of one subgroup's (fp32 and bf16),
    # and the working sets read the gradient with the state
    spilled = memory.streamed_bytes(NUM, LAYERS, RESIDENT, "nvme", nvme=True, subgroup_numel=1 << 20, grads_on="nvme")
    assert spilled["host"] == 3 * 16 * (1 << 20) + 3 * 6 * (1 << 20) + (2 + 2) * 10_000_000 * 2
    assert spilled["nvme"] == NUM * (24 + 8) + (NUM - RESIDENT) * 2


def test_streamed_device_bytes_agree_with_the_runtimes_plan():
    from minioffload.model import streaming
    from minioffload.model.gpt import GPT, GPTConfig
    from minioffload.predict.stepmodel import Workload

    with torch.device("meta"):  # sizes only
        model = GPT(GPTConfig.preset("small", vocab_size=74))
    work = Workload.of(model, 128)
    block = work.block_params * 4
    for k in range(4):
        _, resident, _, window = streaming.plan(model, k, None, None)
        assert window == (k + 1) * block  # the runtime's budget: a block and its k prefetches
        device = memory.streamed_bytes(work.num_params, work.num_layers, work.resident_params, "host", k, "fp32")
        assert device["device"] == sum(p.numel() for p in resident) * 4 + window + block  # + one block's grads


def test_activation_bytes_per_policy():
    s, b, h, a, layers = 1024, 2, 512, 8, 6
    keep = memory.activation_bytes_per_layer(s, b, h, a)
    assert memory.activation_bytes(layers, s, b, h, a) == layers * keep
    assert memory.activation_bytes(layers, s, b, h, a, "recompute") == (layers - 1) * 2 * s * b * h + keep
    assert memory.activation_bytes(layers, s, b, h, a, "selective") == (layers - 1) * 34 * s * b * h + keep
    assert memory.activation_bytes(layers, s, b, h, a, "offload") == keep
    assert memory.activation_bytes(layers, s, b, h, a, "offload_input", value_bytes=4) == 2 * keep
    fused = memory.activation_bytes_per_layer(s, b, h, a, flash_attention=True)  # no scores kept
    assert memory.activation_bytes(layers, s, b, h, a, fused_attention=True) == layers * fused
    assert memory.activation_bytes(layers, s, b, h, a, "selective", fused_attention=True) == layers * fused
    from minioffload.model import activations
    from minioffload.predict import activation_cost
    assert memory.ACTIVATION_POLICIES == activation_cost.POLICIES == activations.POLICIES


@pytest.mark.parametrize("call, match", [
    (lambda: memory.streamed_bytes(NUM, LAYERS, params_on="device"), "must be 'host' or 'nvme'.*got 'device'"),
    (lambda: memory.streamed_bytes(NUM, LAYERS, prefetch=-1), "prefetch must be an int >= 0"),
    (lambda: memory.streamed_bytes(NUM, 0), "num_layers must be a positive integer"),
    (lambda: memory.streamed_bytes(NUM, LAYERS, resident_params=NUM), "resident_params"),
    (lambda: memory.activation_bytes(4, 128, 1, 64, 4, "swap"), "unknown activation policy 'swap'"),
])
def test_bad_streaming_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- Ledger ---------------------------------------------------------------------------------------

def make_ledger():
    ticks = iter(range(10**6))
    return Ledger({"device": 80 * GiB, "host": 512 * GiB, "nvme": None}, clock=lambda: float(next(ticks)))


def state(ledger):
    return ({t: ledger.used(t) for t in ledger.tiers}, {t: ledger.peak(t) for t in ledger.tiers},
            ledger.allocations, ledger.history)


def test_allocate_free_peak_and_history():
    ledger = make_ledger()
    ledger.allocate("weights", "device", 14 * GiB)
    ledger.allocate("grads", "device", 14 * GiB)
    ledger.free("grads")
    ledger.allocate("state", "nvme", 10**15)
    assert ledger.used("device") == 14 * GiB and ledger.peak("device") == 28 * GiB
    assert ledger.free_bytes("device") == 66 * GiB and ledger.free_bytes("nvme") is None
    assert [(e.time, e.name, e.delta, e.used) for e in ledger.history if e.tier == "device"] == [
        (0.0, "weights", 14 * GiB, 14 * GiB), (1.0, "grads", 14 * GiB, 28 * GiB),
        (2.0, "grads", -14 * GiB, 14 * GiB)]
    assert "device" in ledger.summary() and "unbounded" in ledger.summary()


def test_out_of_memory_says_what_was_asked_what_is_free_and_what_to_change():
    ledger = make_ledger()
    ledger.allocate("weights", "device", 70 * GiB)
    before = state(ledger)
    with pytest.raises(OutOfMemoryError) as err:
        ledger.allocate("exp_avg", "device", 28 * GiB)
    message = str(err.value)
    for needle in ("28.00 GiB", "'exp_avg'", "'device'", "10.00 GiB free of 80.00 GiB",
                   "largest holder: 'weights' 70.00 GiB", "another tier"):
        assert needle in message
    assert isinstance(err.value, MemoryError) and err.value.requested == 28 * GiB
    assert state(ledger) == before


@pytest.mark.parametrize("call, match", [
    (lambda L: L.allocate("x", "gpu", 1), "unknown tier 'gpu'"),
    (lambda L: L.allocate("x", "device", 0), "positive integer"),
    (lambda L: L.allocate("x", "device", -1), "positive integer"),
    (lambda L: L.allocate("x", "device", 1.5), "positive integer"),
    (lambda L: L.allocate("", "device", 1), "non-empty"),
    (lambda L: L.allocate("weights", "host", 1), "allocated already"),
    (lambda L: L.free("never"), "never allocated"),
    (lambda L: L.add_tier("device", 1), "exists already"),
    (lambda L: L.add_tier("hbm", 0), "positive"),
    (lambda L: L.used("gpu"), "unknown tier"),
])
def test_refused_calls_raise_clearly_and_change_nothing(call, match):
    ledger = make_ledger()
    ledger.allocate("weights", "device", 1 * GiB)
    before = state(ledger)
    with pytest.raises(ValueError, match=match):
        call(ledger)
    assert state(ledger) == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=40))
def test_ledger_invariants_hold_for_any_sequence(ops):
    ledger = Ledger({"device": 100})
    live: dict[str, int] = {}
    for op, key, size in ops:
        name = f"t{key}"
        try:
            ledger.allocate(name, "device", size) if op == "alloc" else ledger.free(name)
        except (ValueError, OutOfMemoryError):
            continue
        if op == "alloc":
            live[name] = size
        else:
            del live[name]
        assert ledger.used("device") == sum(live.values()) <= 100
    assert ledger.peak("device") == max([0] + [e.used for e in ledger.history])


def test_ledger_is_thread_safe():
    ledger = Ledger({"device": 10**9})

    def churn(worker):
        for i in range(500):
            ledger.allocate(f"{worker}-{i}", "device", 7)
            ledger.free(f"{worker}-{i}")

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.used("device") == 0 and len(ledger.history) == 4000


def test_format_bytes():
    assert memory.format_bytes(1536) == "1.50 KiB"
    assert memory.format_bytes(3 * GiB) == "3.00 GiB"
    assert memory.format_bytes(12) == "12 B"
