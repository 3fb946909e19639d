"""`python -m minioffload footprint`: the chapter 1 calculator on the command line."""

import re
import subprocess
import sys

import pytest

from minioffload.cli.main import main, parse_count


def test_footprint_prints_the_table_and_the_verdict(capsys):
    assert main(["footprint", "--params", "7B", "--gpu-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "total       device        16" in out
    assert re.search(r"device\s+112.0 GB", out)
    assert "does NOT fit one 80 GB GPU" in out and "least offloaded placement that fits: optimizer_cpu" in out


def test_footprint_with_offload_fits(capsys):
    main(["footprint", "--params", "13b", "--placement", "optimizer_cpu"])
    out = capsys.readouterr().out
    assert re.search(r"host\s+234.0 GB", out) and "fits one 80 GB GPU (26.0 GB" in out


@pytest.mark.parametrize("text, value", [("7B", 7e9), ("124M", 124e6), ("1.5e9", 1.5e9), (" 2t ", 2e12)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("argv, message", [
    (["footprint", "--params", "seven"], "not a positive parameter count"),
    (["footprint", "--params", "0"], "not a positive parameter count"),
    (["footprint", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["footprint", "--gpu-gb", "-1"], "--gpu-gb must be a positive number of GB"),
])
def test_bad_arguments_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "minioffload", "footprint", "--params", "124M"],
                            capture_output=True, text=True, check=True)
    assert "fits one 80 GB GPU" in result.stdout


def test_train_runs_and_prints_its_summary(tmp_path, capsys):
    argv = ["train", "--device", "sim", "--steps", "2", "--block-size", "16", "--batch-size", "4",
            "--max-grad-norm", "none", "--no-progress", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exposed D2H" in out and "CPU update" in out and "device peak memory" in out
    assert {p.name for p in tmp_path.iterdir()} == {"trace.json", "loss.csv", "summary.json"}


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "0"], "--steps must be a positive int, got 0"),
    (["train", "--lr", "-1"], "--lr must be a positive finite number"),
    (["train", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["train", "--max-grad-norm", "big"], "is not a number"),
    (["train", "--batch-size", "1.5"], "invalid int value"),
])
def test_train_bad_flags_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_hardware_lists_every_preset_and_cites_one(capsys):
    from minioffload.machine import profiles

    main(["hardware"])
    out = capsys.readouterr().out
    assert all(name in out for name in profiles.PRESETS)
    main(["hardware", "h200"])
    out = capsys.readouterr().out
    assert "4.80 TB/s" in out and "H200 datasheet" in out and "link_theoretical" in out


def test_hardware_unknown_preset_is_a_usage_error_listing_the_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["hardware", "h300"])
    assert exit_info.value.code == 2
    assert "choose one of a100-pcie, h100-sxm" in capsys.readouterr().err


def test_step_predicts_and_names_the_bound(capsys, tmp_path):
    main(["step", "--params", "7B", "--hardware", "h100-sxm", "--trace", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert re.search(r"predicted step \d+\.\d+ s .* bound by cpu", out)
    assert (tmp_path / "t.json").exists()
    main(["step", "--params", "7B", "--hardware", "h100-sxm", "--delay-updates-after", "0"])
    delayed = float(re.search(r"predicted step (\d+\.\d+) s", capsys.readouterr().out)[1])
    assert delayed < float(re.search(r"predicted step (\d+\.\d+) s", out)[1])


@pytest.mark.parametrize("argv, message", [
    (["step", "--stride", "0"], "stride must be an int >= 1"),
    (["step", "--delay-updates-after", "0", "--optimizer-on", "nvme"], "choose one"),
    (["step", "--mfu", "2"], "mfu must be in"),
    (["footprint", "--hardware", "h300"], "unknown hardware preset"),
    (["footprint", "--delay", "--placement", "device"], "--delay counts"),
])
def test_step_and_footprint_refuse_bad_options_with_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_footprint_reads_the_gpu_memory_from_the_hardware_table(capsys):
    main(["footprint", "--params", "70B", "--placement", "params_nvme", "--hardware", "h200"])
    out = capsys.readouterr().out
    assert "fits one 141 GB GPU" in out and re.search(r"host\s+420.0 GB", out)
