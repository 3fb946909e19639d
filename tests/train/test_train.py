"""The training loop (minioffload/train/loop.py): short runs on the sim device, files, the step-time split."""

import csv
import json

import pytest

from minioffload.cli.main import main
from minioffload.options import OffloadOptions
from minioffload.trace import Span
from minioffload.train.loop import PHASES, TrainConfig, step_phases, train

SHORT = dict(device="sim", model="tiny", block_size=32, batch_size=8, lr=3e-3, eval_every=5, progress=False)


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory):
    return train(TrainConfig(steps=12, out_dir=str(tmp_path_factory.mktemp("offload")), **SHORT))


def test_offload_run_learns_and_writes_its_files(offload_run):
    r = offload_run
    assert len(r.losses) == 12 and r.losses[-1] < r.losses[0] - 0.3
    assert set(r.val_losses) == {5, 10, 12}
    trace = json.loads(r.paths["trace"].read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"forward", "backward", "d2h grad", "h2d weights"} <= names
    with open(r.paths["loss"]) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "train_loss", "val_loss", "tokens_per_s"]
    assert [int(row["step"]) for row in rows] == list(range(1, 13))
    assert rows[4]["val_loss"] and not rows[0]["val_loss"] and float(rows[0]["tokens_per_s"]) > 0
    summary = json.loads(r.paths["summary"].read_text())
    assert summary == r.summary
    assert len(summary["sample"]) == 200 and summary["optimizer_host_bytes"] > 0
    assert summary["device_peak_bytes"] > 0


def test_split_is_non_negative_and_fits_in_the_step(offload_run):
    s = offload_run.summary
    split = [s[f"{phase}_s"] for phase in PHASES]
    assert all(t >= 0 for t in split) and s["other_s"] >= 0
    assert sum(split) <= s["step_s"] * (1 + 1e-9)
    assert s["forward_s"] > 0 and s["backward_s"] > 0 and s["cpu_update_s"] > 0
    assert s["device_update_s"] == 0


def test_exposed_copy_time_counts_only_what_nothing_else_hides():
    spans = [Span("compute", "backward", 0.0, 1.0), Span("d2h", "d2h grad", 0.5, 1.5),
             Span("cpu", "adam", 1.5, 2.0), Span("h2d", "h2d weights", 1.8, 2.6)]
    phases = step_phases(spans, 0.0, 2.5)  # the window cuts the last copy at 2.5
    assert phases["exposed_d2h"] == pytest.approx(0.5) and phases["exposed_h2d"] == pytest.approx(0.5)
    assert phases["backward"] == 1.0 and phases["cpu_update"] == 0.5 and phases["forward"] == 0


def test_same_seed_same_losses(offload_run, tmp_path):
    again = train(TrainConfig(steps=12, out_dir=str(tmp_path), **SHORT))
    assert again.losses == offload_run.losses and again.val_losses == offload_run.val_losses


def test_baseline_without_offload_runs(offload_run, tmp_path):
    r = train(TrainConfig(steps=6, offload=False, grad_accum=2, out_dir=str(tmp_path), **SHORT))
    s = r.summary
    assert r.losses[-1] < r.losses[0] and s["device_update_s"] > 0 and s["cpu_update_s"] == 0
    assert s["optimizer_host_bytes"] == 0
    assert s["device_peak_bytes"] > offload_run.summary["device_peak_bytes"]  # grads and Adam state on device


def test_bf16_runs(tmp_path):
    r = train(TrainConfig(steps=6, precision="bf16", out_dir=str(tmp_path), **SHORT))
    assert r.losses[-1] < r.losses[0] and r.summary["config"]["precision"] == "bf16"


@pytest.mark.parametrize("field, value", [
    ("device", "tpu"), ("model", "huge"), ("precision", "fp8"), ("steps", 0), ("batch_size", -1),
    ("block_size", 2.5), ("lr", 0.0), ("grad_accum", 0), ("eval_every", 0), ("offload", "yes"),
    ("optimizer", {"stride": 2}),
])
def test_bad_config_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"TrainConfig.{field} "):
        TrainConfig(**{field: value})


def test_the_optimizer_options_are_checked_by_their_own_rules():
    # the engine's options are OffloadOptions (tests/vocabulary/test_options.py checks every rule); TrainConfig adds two
    with pytest.raises(ValueError, match="delay_updates_after is an option of the offloaded optimizer .OffloadAdam., "
                                         "and optimizer_on='device' .train: offload=False."):
        TrainConfig(offload=False, optimizer=OffloadOptions(delay_updates_after=0))
    with pytest.raises(ValueError, match="TrainConfig.nvme_dir keeps OffloadAdam's state in files"):
        TrainConfig(offload=False, nvme_dir="somewhere")
    with pytest.raises(ValueError, match="NVMe tier does not combine"):
        TrainConfig(optimizer=OffloadOptions(stride=2), nvme_dir="somewhere")
    assert TrainConfig(offload=False, optimizer=OffloadOptions(max_grad_norm=0.5)).optimizer.max_grad_norm == 0.5


def test_block_size_longer_than_the_validation_split_is_refused(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        train(TrainConfig(**{**SHORT, "block_size": 100_000}, steps=1, out_dir=str(tmp_path)))


def test_cli_flags_reach_the_config(tmp_path, capsys):
    argv = ["train", "--device", "sim", "--steps", "2", "--block-size", "16", "--batch-size", "4", "--no-offload",
            "--precision", "bf16", "--grad-accum", "2", "--no-progress", "--out-dir", str(tmp_path)]
    with pytest.warns(UserWarning, match="no fp32 master"):
        assert main(argv) == 0
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert config["offload"] is False and config["precision"] == "bf16" and config["grad_accum"] == 2
    assert "AdamW on the device (baseline)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--grad-accum", "0"])
    assert exit_info.value.code == 2 and "--grad-accum must be a positive int" in capsys.readouterr().err


def test_delayed_updates_and_kept_parameters_from_the_command_line(tmp_path, capsys):
    for flags in (["--delay-updates-after", "2"], ["--min-offload-numel", "1000"], ["--stride", "2"],
                  ["--nvme-dir", str(tmp_path / "nvme")]):
        out = tmp_path / flags[0].strip("-")
        assert main(["train", "--device", "sim", "--steps", "8", "--block-size", "16", "--batch-size", "8",
                     "--no-progress", "--out-dir", str(out), *flags]) == 0
        summary = json.loads((out / "summary.json").read_text())
        field = flags[0].strip("-").replace("-", "_")
        assert str(summary["config"][field]) == flags[1]
        with open(out / "loss.csv") as f:
            losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
        assert losses[-1] < losses[0] - 0.1  # it learns
    with pytest.raises(SystemExit):
        main(["train", "--delay-updates-after", "1", "--min-offload-numel", "10"])
    err = capsys.readouterr().err
    assert "--delay-updates-after needs every parameter offloaded" in err and "set --min-offload-numel=0" in err
    with pytest.raises(SystemExit):
        main(["train", "--no-offload", "--stride", "2"])
    assert ("error: --stride is an option of the offloaded optimizer (OffloadAdam), and --no-offload keeps torch's "
            "AdamW on the device: drop it, or offload the optimizer, --offload\n") in capsys.readouterr().err


def test_activation_policies_train_the_same_losses(tmp_path):
    runs = {policy: train(TrainConfig(steps=3, activations=policy, out_dir=str(tmp_path / policy.replace(",", "_")),
                                      **SHORT)).losses
            for policy in ("keep", "offload", "recompute,offload_input")}
    assert runs["offload"] == runs["keep"] == runs["recompute,offload_input"]
    with pytest.raises(ValueError, match="TrainConfig.activations must be one of"):
        TrainConfig(activations="fast")
    with pytest.raises(ValueError, match="lists 3 policies and the tiny model has 2 blocks"):
        train(TrainConfig(activations="keep,keep,keep", out_dir=str(tmp_path / "bad"), **SHORT))
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_streamed_weights_train_the_same_losses_from_the_command_line(tmp_path, capsys):
    resident = train(TrainConfig(steps=3, out_dir=str(tmp_path / "resident"), **SHORT)).losses
    host = train(TrainConfig(steps=3, params_on="host", prefetch=0, out_dir=str(tmp_path / "host"), **SHORT))
    assert host.losses == resident and host.summary["weights_over_device"] > 0
    assert host.summary["streamed_peak_bytes"] <= host.summary["stream_budget_bytes"]
    assert main(["train", "--device", "sim", "--model", "tiny", "--block-size", "32", "--batch-size", "8",
                 "--steps", "3", "--no-progress", "--params-on", "nvme", "--nvme-dir", str(tmp_path / "disk"),
                 "--prefetch", "2", "--device-memory", "700KB", "--out-dir", str(tmp_path / "nvme")]) == 0
    out = capsys.readouterr().out
    assert "weights streamed    from nvme, 2 ahead" in out
    summary = json.loads((tmp_path / "nvme" / "summary.json").read_text())
    assert summary["final_train_loss"] == pytest.approx(resident[-1], abs=0) and summary["fetches"] > 0
    assert (tmp_path / "disk" / "weights" / "index.json").exists()
    # the weights on NVMe, the optimizer's state in host memory: a directory of their own
    assert main(["train", "--device", "sim", "--model", "tiny", "--block-size", "32", "--batch-size", "8",
                 "--steps", "3", "--no-progress", "--params-on", "nvme", "--weights-dir", str(tmp_path / "w"),
                 "--device-memory", "700KB", "--out-dir", str(tmp_path / "apart")]) == 0
    summary = json.loads((tmp_path / "apart" / "summary.json").read_text())
    assert summary["final_train_loss"] == pytest.approx(resident[-1], abs=0)
    assert summary["optimizer_nvme_bytes"] == 0 and (tmp_path / "w" / "index.json").exists()


@pytest.mark.parametrize("fields, words", [
    ({"params_on": "disk"}, "TrainConfig.params_on must be one of"),
    ({"prefetch": -1}, "TrainConfig.prefetch must be an int >= 0"),
    ({"params_on": "nvme"}, "give TrainConfig.weights_dir"),
    ({"weights_dir": "w"}, "TrainConfig.weights_dir is the home of weights streamed from NVMe"),
    ({"params_on": "host", "optimizer": OffloadOptions(delay_updates_after=1)}, "take the synchronous CPU update only"),
    ({"params_on": "host", "offload": False}, "params_on='host' streams weights that the CPU optimizer updates"),
    ({"device_memory": 0}, "TrainConfig.device_memory must be a positive number of bytes"),
])
def test_bad_streaming_settings_are_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**fields)


def test_lazy_async_checkpoints_resume_the_run_exactly(tmp_path):
    from minioffload.train import checkpoint_async

    base = dict(model="tiny", steps=6, batch_size=4, block_size=32, eval_every=100, progress=False)
    straight = train(TrainConfig(**base, out_dir=str(tmp_path / "straight")))
    first = TrainConfig(**{**base, "steps": 4}, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                        out_dir=str(tmp_path / "first"))
    train(first)
    assert [p.name for p in sorted(checkpoint_async.complete(tmp_path / "ckpt"))] == ["step00000002", "step00000004"]
    resumed = train(TrainConfig(**base, resume=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "resumed")))
    assert resumed.losses == straight.losses[4:]
    with pytest.raises(ValueError, match="checkpoint_every writes lazy asynchronous checkpoints"):
        TrainConfig(**base, checkpoint_every=2)


@pytest.mark.parametrize("lazy, params_on", [(True, "device"), (False, "device"), (True, "host"), (False, "host")],
                         ids=["lazy async", "torch.distributed.checkpoint", "lazy async, streamed",
                              "torch.distributed.checkpoint, streamed"])
def test_a_resumed_run_with_kept_parameters_continues_exactly(lazy, params_on, tmp_path):
    """The small parameters kept on the device have torch's AdamW state: a resumed run must get it back (a fresh
    optimizer has none yet, and torch.distributed.checkpoint loads only what it is asked for). Streamed weights
    (params_on host) are saved from home: their device tensors have no memory between uses."""
    kept = OffloadOptions(subgroup_numel=1 << 16, max_grad_norm=1.0, min_offload_numel=1000)
    base = dict(model="tiny", steps=4, batch_size=4, block_size=32, grad_accum=2, eval_every=100, progress=False,
                device="sim", optimizer=kept, params_on=params_on)
    straight = train(TrainConfig(**base, out_dir=str(tmp_path / "straight")))
    train(TrainConfig(**{**base, "steps": 2}, checkpoint_dir=str(tmp_path / "ckpt"),
                      checkpoint_every=2 if lazy else None, out_dir=str(tmp_path / "first")))
    resumed = train(TrainConfig(**base, resume=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "resumed")))
    assert resumed.losses == straight.losses[2:]


def test_a_run_leaves_no_optimizer_behind(tmp_path):
    """train() in a loop (a benchmark, a sweep) must not keep each run's optimizer and its buffers alive."""
    import gc

    from minioffload.engine.optimizer import OffloadAdam

    def alive() -> int:
        gc.collect()
        return sum(type(o) is OffloadAdam for o in gc.get_objects())

    before = alive()
    train(TrainConfig(steps=2, out_dir=str(tmp_path), **SHORT))
    assert alive() == before


def test_gradients_on_nvme_train_the_same_losses_from_the_command_line(tmp_path, capsys):
    """Everything off the host but a few pinned sets: weights streamed from NVMe, the optimizer's state and the
    gradients (accumulated over two micro-batches) there too; bf16, clipping on. The losses are the run's with the
    gradients summed in host memory, bit for bit; the optimizer pins less (its sets are a few subgroups')."""
    common = dict(steps=3, grad_accum=2, precision="bf16", params_on="nvme", prefetch=1, device_memory=700_000,
                  optimizer=TrainConfig().optimizer.replace(max_grad_norm=0.5, subgroup_numel=8192), **SHORT)
    host = train(TrainConfig(nvme_dir=str(tmp_path / "host-disk"), out_dir=str(tmp_path / "host"), **common))
    argv = ["train", "--device", "sim", "--model", "tiny", "--block-size", "32", "--batch-size", "8", "--steps", "3",
            "--grad-accum", "2", "--precision", "bf16", "--params-on", "nvme", "--device-memory", "700KB",
            "--max-grad-norm", "0.5", "--subgroup-numel", "8192", "--grads-on", "nvme", "--grad-buffers", "2",
            "--nvme-dir", str(tmp_path / "disk"),
            "--no-progress", "--out-dir", str(tmp_path / "nvme")]
    assert main(argv) == 0
    assert "OffloadAdam (state and gradients on NVMe, 2 pinned gradient sets)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "nvme" / "summary.json").read_text())
    losses = [float(row["train_loss"]) for row in csv.DictReader(open(tmp_path / "nvme" / "loss.csv"))]
    assert losses == pytest.approx(host.losses, abs=1e-6) and summary["final_train_loss"] == host.losses[-1]
    assert summary["optimizer_host_bytes"] < host.summary["optimizer_host_bytes"]
    with pytest.raises(ValueError, match="grads_on='nvme' keeps the gradients on the NVMe tier's drive"):
        TrainConfig(grads_on="nvme")
