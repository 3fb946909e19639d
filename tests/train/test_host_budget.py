"""A run's pinned host memory: counted before it starts (train/host_budget.py), refused over its budget before
anything is made, held to it as it runs (pinned.HostBudget), and its measured peak in the summary."""

import json
from pathlib import Path

import pytest
import torch

from minioffload.cli.main import main
from minioffload.model.gpt import GPT, CharTokenizer, GPTConfig, load_text
from minioffload.options import OffloadOptions
from minioffload.train import host_budget
from minioffload.train.loop import TrainConfig, preflight, train

SHORT = dict(device="sim", model="tiny", block_size=32, batch_size=8, steps=3, eval_every=3, progress=False)


def need_of(config: TrainConfig) -> dict[str, int]:
    with torch.device("meta"):
        shape = GPT(GPTConfig.preset(config.model, CharTokenizer(load_text()).vocab_size, block_size=config.block_size))
    return host_budget.pinned_need(config, shape, on_sim=True)


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """A run with offloaded activations and no budget: what it pins, counted and measured."""
    config = TrainConfig(activations="offload", out_dir=str(tmp_path_factory.mktemp("unbounded")), **SHORT)
    return config, need_of(config), train(config).summary


def test_the_count_is_what_the_run_pins_at_its_peak(unbounded):
    config, need, summary = unbounded
    assert need["optimizer"] == summary["optimizer_host_bytes"] > 0
    assert need["activations"] > 0
    assert summary["host_pinned_peak_bytes"] == host_budget.peak(need) == sum(need.values()), need


@pytest.mark.parametrize("fields", [
    dict(precision="bf16"), dict(grad_accum=2, activations="offload_input"),
    dict(optimizer=OffloadOptions(subgroup_numel=1 << 14, delay_updates_after=0)),
    dict(optimizer=OffloadOptions(subgroup_numel=1 << 14, gpu_fraction=0.5)),
    dict(optimizer=OffloadOptions(speculative=True)), dict(nvme_dir="nvme"), dict(params_on="host"),
    dict(params_on="host", precision="bf16", prefetch=0),
    dict(nvme_dir="nvme", grads_on="nvme", grad_accum=2, precision="bf16",
         optimizer=OffloadOptions(subgroup_numel=1 << 14, grad_buffers=2))],
    ids=["bf16", "accumulated", "delayed", "hybrid", "speculative", "nvme", "streamed", "streamed-bf16", "grads-nvme"])
def test_the_count_is_exact_for_every_configuration_it_takes(fields, tmp_path):
    if "nvme_dir" in fields:
        fields = {**fields, "nvme_dir": str(tmp_path / "nvme")}
    config = TrainConfig(out_dir=str(tmp_path / "out"), **{**SHORT, "steps": 2, "eval_every": 2, **fields})
    assert train(config).summary["host_pinned_peak_bytes"] == host_budget.peak(need_of(config))


def test_a_budget_below_the_count_is_refused_before_anything_is_made(tmp_path, unbounded):
    _, need, _ = unbounded
    out = tmp_path / "never"
    config = TrainConfig(activations="offload", host_budget=host_budget.peak(need) - 1, out_dir=str(out), **SHORT)
    with pytest.raises(ValueError, match=r"host_budget=.* is below what this run pins.*optimizer .*activations"):
        train(config)
    assert not out.exists()


def test_a_run_within_its_budget_trains_and_stays_under_it(tmp_path, unbounded):
    _, need, reference = unbounded
    budget = host_budget.peak(need)
    config = TrainConfig(activations="offload", host_budget=budget, out_dir=str(tmp_path), **SHORT)
    summary = train(config).summary
    assert summary["host_pinned_peak_bytes"] <= budget == summary["host_budget"]
    assert summary["final_train_loss"] == reference["final_train_loss"]  # a budget changes where, never what


def test_the_optimizer_state_on_nvme_needs_less_host_memory_when_its_working_sets_are_small(tmp_path):
    small = OffloadOptions(subgroup_numel=1 << 14)
    on_host = TrainConfig(optimizer=small, out_dir=str(tmp_path / "a"), **SHORT)
    on_nvme = TrainConfig(optimizer=small, nvme_dir=str(tmp_path / "nvme"), out_dir=str(tmp_path / "b"), **SHORT)
    assert need_of(on_nvme)["optimizer"] < need_of(on_host)["optimizer"]
    # three working sets of the largest subgroup: with one subgroup as large as the model, more than it saves
    large = TrainConfig(nvme_dir=str(tmp_path / "nvme"), out_dir=str(tmp_path / "c"), **SHORT)
    assert need_of(large)["optimizer"] > need_of(TrainConfig(**SHORT))["optimizer"]
    recomputed = TrainConfig(activations="recompute", out_dir=str(tmp_path / "c"), **SHORT)
    assert need_of(recomputed)["activations"] == 0


def test_the_budget_flag_reaches_the_config_and_the_summary_prints_the_peak(tmp_path, capsys):
    main(["train", "--device", "sim", "--model", "tiny", "--block-size", "32", "--batch-size", "8", "--steps", "2",
          "--eval-every", "2", "--no-progress", "--host-budget", "64MB", "--out-dir", str(tmp_path)])
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())
    assert summary["host_budget"] == 64_000_000 and 0 < summary["host_pinned_peak_bytes"] <= 64_000_000
    assert "of a 61.04 MiB budget" in capsys.readouterr().out


@pytest.mark.parametrize("fields", [dict(params_on="nvme", nvme_dir="nv"),
                                    dict(checkpoint_dir="ck", checkpoint_every=2)])
def test_what_is_not_counted_yet_is_refused_with_a_budget(fields):
    with pytest.raises(ValueError, match="not counted yet"):
        TrainConfig(host_budget=1 << 30, **{**SHORT, **fields})


@pytest.mark.parametrize("value", [0, -5, 1.5, True])
def test_a_bad_budget_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="TrainConfig.host_budget must be a positive number of bytes"):
        TrainConfig(host_budget=value, **SHORT)


def test_preflight_refuses_without_touching_the_output_directory(tmp_path):
    out = tmp_path / "untouched"
    with pytest.raises(ValueError, match="is below what this run pins"):
        preflight(TrainConfig(host_budget=1, out_dir=str(out), **SHORT))
    assert not out.exists()
