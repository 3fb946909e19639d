"""The chapters read recorded benchmark results through one function, from any folder."""

import pytest

from minioffload.course import results


def test_load_reads_a_recorded_run_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a notebook copied elsewhere still finds the repository's results
    run = results.load("step_model")
    assert {"machine", "config", "rows", "headline"} <= run.keys()


def test_a_missing_result_names_the_bench_to_run():
    with pytest.raises(FileNotFoundError, match=r"run `python bench/no_such_bench.py`.*recorded: .*adam"):
        results.load("no_such_bench")
