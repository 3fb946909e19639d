"""The in-page explorers (minioffload.course.explore): their data agree with memory, plan and the trace; bad
arguments say what to change; what goes into a page names no network URL. No browser here: see
tests/book/test_book_explorers.py for the charts moving in Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from minioffload.course import explore
from minioffload.course.explore.chart import JAVASCRIPT_MIME, VEGALITE_MIME
from minioffload.course.explore.footprint import GB_EXPR
from minioffload.course.explore.hiding import MECHANISMS, SIZES, THRESHOLD_EXPR, gpu_presets
from minioffload.machine.profiles import preset
from minioffload.planner import search as planner
from minioffload.predict import hiding
from minioffload.predict.memory import OPTIMIZERS, PLACEMENTS, PRECISIONS, TIERS, footprint
from minioffload.predict.shapes import ModelSpec
from minioffload.predict.stepmodel import StepConfig, Workload, predict
from minioffload.trace import Trace
from minioffload.units import GB


def evaluate(expression: str, datum: dict, **params: float) -> float:
    """A Vega arithmetic expression (datum fields, params, + - * /, pow) evaluated in Python."""
    python = re.sub(r"datum\.(\w+)", r"datum['\1']", expression)
    if not re.fullmatch(r"[\w\s.,'\[\]()*/+-]+", python):
        raise ValueError(f"not the arithmetic this helper evaluates: {expression}")
    return eval(python, {"__builtins__": {}}, {"pow": pow, "datum": datum, **params})  # noqa: S307


def layer_transforms(spec: dict, index: int) -> list[dict]:
    return spec["layer"][index]["transform"]


def test_the_footprint_table_holds_every_setup_and_sums_to_the_calculator():
    rows = explore.footprint_table()
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            for placement in PLACEMENTS:
                mine = [r for r in rows if (r["precision"], r["optimizer"], r["placement"]) ==
                        (precision, optimizer, placement)]
                fp = footprint(precision, optimizer, placement)
                assert [r["part"] for r in mine] == [p.name for p in fp.parts]
                for tier in TIERS:
                    assert sum(r["bytes_per_param"] for r in mine if r["tier"] == tier) == fp.per_param(tier)
                assert {r["device_bpp"] for r in mine} == {fp.per_param("device")}


@pytest.mark.parametrize("log10_params", [8.0, 9.845, 11.5])
def test_the_footprint_charts_gb_are_the_calculators_bytes(log10_params):
    spec = explore.footprint_chart().spec
    assert {"calculate": GB_EXPR, "as": "GB"} in layer_transforms(spec, 0)
    num_params = 10 ** log10_params
    for precision, optimizer, placement in [("mixed_bf16", "adam", "device"), ("fp32", "sgd_momentum", "params_nvme"),
                                            ("bf16", "adamw", "optimizer_cpu")]:
        rows = [r for r in spec["datasets"]["footprint"]
                if (r["precision"], r["optimizer"], r["placement"]) == (precision, optimizer, placement)]
        for tier in TIERS:
            drawn = sum(evaluate(GB_EXPR, r, log10_params=log10_params) for r in rows if r["tier"] == tier)
            assert drawn == pytest.approx(footprint(precision, optimizer, placement).bytes(num_params, tier) / 1e9,
                                          rel=1e-9)


def test_the_footprint_chart_starts_where_it_is_told_and_binds_its_controls():
    spec = explore.footprint_chart(num_params=13e9, precision="fp32", optimizer="sgd_momentum",
                                   placement="optimizer_cpu", gpu_gb=24).spec
    params = {p["name"]: p for p in spec["params"]}
    assert 10 ** params["log10_params"]["value"] == pytest.approx(13e9, rel=2e-3)
    assert params["gpu_gb"]["value"] == 24 and params["precision"]["value"] == "fp32"
    assert params["placement"]["bind"]["options"] == list(PLACEMENTS)
    assert params["log10_params"]["bind"]["input"] == "range" and params["gpu_gb"]["bind"]["input"] == "range"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"placement": "gpu"}, "unknown placement 'gpu'"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"num_params": 5e12}, "num_params must be"),
    ({"gpu_gb": 1000}, "gpu_gb must be"),
])
def test_the_footprint_chart_refuses_bad_arguments_and_says_why(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        explore.footprint_chart(**kwargs)


HIDING = {"weights streamed from host": (hiding.streamed_fetch, ("host",)),
          "weights streamed from NVMe": (hiding.streamed_fetch, ("nvme",)),
          "gradients to the host": (hiding.gradient_copies, ()), "delayed CPU update": (hiding.delayed_update, ()),
          "lazy checkpoint write": (hiding.checkpoint_write, ())}


@pytest.mark.parametrize("mfu", [0.15, 0.4, 0.9])
def test_the_hiding_charts_thresholds_are_predict_hidings_at_every_mfu(mfu):
    rows = explore.hiding_table()
    assert len(rows) == len(gpu_presets()) * len(SIZES) * len(MECHANISMS)
    for row in rows[::7]:
        work, hw = ModelSpec.of_params(SIZES[row["size"]]).workload(2048), preset(row["preset"])
        condition_of, home = HIDING[row["mechanism"]]
        want = condition_of(work, hw, *home, mfu=mfu)
        assert evaluate(THRESHOLD_EXPR, row, mfu=mfu) == pytest.approx(want.threshold, rel=1e-9)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preset": "laptop-sim"}, "unknown GPU preset 'laptop-sim'"),
    ({"size": "1T"}, "unknown size '1T'"),
    ({"tokens": 10}, "tokens must be from 100"),
    ({"mfu": 0}, "mfu must be from 0.05 to 1"),
])
def test_the_hiding_chart_refuses_bad_arguments_and_says_why(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        explore.hiding_chart(**kwargs)


def a_trace() -> Trace:
    trace = Trace(origin=0.0)
    trace.record("compute", "forward", 0.0, 0.004)
    trace.record("h2d", "copy 0", 0.001, 0.002, 1 << 20)
    trace.record("d2h", "grads", 0.003, 0.005, 2 << 20)
    return trace


def test_the_timeline_chart_draws_the_traces_spans_with_a_toggle_per_lane():
    trace = a_trace()
    spec = explore.timeline_chart(trace).spec
    rows = spec["data"]["values"]
    assert [(r["lane"], r["name"], r["start_ms"] / 1e3, r["end_ms"] / 1e3, r["bytes"]) for r in rows] == [
        (s.lane, s.name, s.start, s.end, s.nbytes) for s in trace.spans]
    toggles = [p for p in spec["params"] if p.get("bind", {}).get("input") == "checkbox"]
    assert [t["bind"]["name"].strip() for t in toggles] == trace.lanes()
    assert any(p.get("select", {}).get("type") == "interval" for p in spec["vconcat"][1]["params"])  # the zoom
    only = explore.timeline_chart(trace, lanes=["d2h", "compute"]).spec
    assert {r["lane"] for r in only["data"]["values"]} == {"d2h", "compute"}
    assert [t["bind"]["name"].strip() for t in only["params"]] == ["d2h", "compute"]


def test_the_timeline_chart_refuses_what_is_not_a_trace_with_spans():
    with pytest.raises(TypeError, match="needs a minioffload.trace.Trace"):
        explore.timeline_chart([("h2d", 0, 1)])
    with pytest.raises(ValueError, match="no spans"):
        explore.timeline_chart(Trace())
    with pytest.raises(ValueError, match=r"lanes \['nvme_read'\] not in the trace"):
        explore.timeline_chart(a_trace(), lanes=["nvme_read"])
    with pytest.raises(TypeError, match="list of lane names"):
        explore.timeline_chart(a_trace(), lanes="h2d")


SMALL_GRID = {"sizes": (1.3e9, 175e9), "hardware": ("h100-sxm",), "host_gb": (1024,), "nvme_gb": (0,)}


def test_the_plan_grid_holds_the_planners_best_plans_and_what_nothing_fitting_lacks():
    rows = explore.plan_grid(**SMALL_GRID)
    limits = planner.Limits(batch=explore.DEFAULT_GRID["batch"], host_bytes=1024 * GB, nvme_bytes=0)
    spec, hw = planner.ModelSpec.of_params(1.3e9), preset("h100-sxm")
    best = planner.best_per_family(planner.search(spec, hw, limits))[:4]
    fitted = [r for r in rows if r["size"] == "1.3B"]
    assert len(fitted) == 3 * len(best)
    for rank, p in enumerate(best, 1):
        for tier in ("device", "host", "nvme"):
            row = next(r for r in fitted if r["rank"] == rank and r["tier"] == tier)
            assert row["bytes"] == p.memory[tier]
            assert row["tokens_per_s"] == pytest.approx(p.tokens_per_s, abs=0.06)
            assert row["capacity"] == limits.capacity(hw)[tier]
    with pytest.raises(planner.NoPlanError) as err:
        planner.search(planner.ModelSpec.of_params(175e9), hw, limits)
    closest = {r["tier"]: r for r in rows if r["size"] == "175B"}
    assert set(closest) == {"device", "host", "nvme"} and all(r["plan"] == "closest" for r in closest.values())
    for tier, row in closest.items():
        assert row["bytes"] == pytest.approx((limits.capacity(hw)[tier] or 0) + err.value.short.get(tier, 0.0))
        assert row["over"] == (err.value.short.get(tier, 0.0) > 0)


def test_the_plan_chart_selects_a_grid_point_with_its_menus():
    chart = explore.plan_chart(size=1.3e9, hardware="h100-sxm", host_gb=1024, nvme_gb=0, grid=SMALL_GRID)
    params = {p["name"]: p for p in chart.spec["params"]}
    assert params["size"]["bind"]["options"] == ["1.3B", "175B"] and params["size"]["value"] == "1.3B"
    assert params["hardware"]["value"] == "h100-sxm" and params["nvme_gb"]["value"] == 0
    assert chart.spec["transform"][0]["filter"].count("datum.") == 4
    assert chart.spec["autosize"]["resize"]  # points differ in their number of plans: the text must not clip


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hardware": "tpu"}, "not in the grid"),
    ({"size": 7e9}, "not in the grid"),
    ({"grid": {**SMALL_GRID, "batch": 0}}, "batch must be a positive int"),
    ({"grid": {**SMALL_GRID, "gpus": (1,)}}, "unknown grid key(s) ['gpus']"),
    ({"grid": {**SMALL_GRID, "hardware": ("h100",)}}, "unknown hardware preset(s) ['h100']"),
    ({"grid": {**SMALL_GRID, "host_gb": ()}}, "host_gb must be a non-empty list"),
])
def test_the_plan_chart_refuses_bad_arguments_and_says_why(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        explore.plan_chart(**{"size": 1.3e9, "host_gb": 1024, "nvme_gb": 0, "grid": SMALL_GRID, **kwargs})


def a_streamed_workload() -> Workload:
    return Workload(7_000_000_000, 8 * 4096, num_tensors=291, num_layers=32, resident_params=10**8)


def charts() -> list[explore.Chart]:
    return [explore.footprint_chart(), explore.timeline_chart(a_trace(), title="a </script> in a title"),
            explore.plan_chart(size=1.3e9, host_gb=1024, nvme_gb=0, grid=SMALL_GRID),
            explore.streaming_chart(a_streamed_workload(), preset("h100-sxm")), explore.hiding_chart()]


@pytest.mark.parametrize("chart", charts(), ids=lambda c: c.name)
def test_a_chart_shows_as_vega_lite_in_jupyterlab_and_as_a_script_in_the_book(chart):
    spec_only, script = chart.outputs()
    assert set(spec_only) == {VEGALITE_MIME}  # nothing the book renders, nothing JupyterLab prefers to Vega-Lite
    assert set(script) == {JAVASCRIPT_MIME, "text/plain"}  # no text/html: JupyterLab would prefer it
    assert spec_only[VEGALITE_MIME] == json.loads(json.dumps(chart.spec))
    for page_text in (script[JAVASCRIPT_MIME], chart.html()):
        assert "http://" not in page_text and "https://" not in page_text and "//cdn" not in page_text
        assert not re.search(r"<script[^>]*\bsrc=", page_text)
        assert "</script" not in page_text.replace('<script type="text/javascript">', "").rsplit("</script>", 1)[0]
    assert "_static/vega/" in script[JAVASCRIPT_MIME] and "vega-embed.min.js" in script[JAVASCRIPT_MIME]
    assert "if (!here) { return; }" in script[JAVASCRIPT_MIME]  # JupyterLab runs it without a <script> element
    assert chart.script() == chart.script()  # the same output every run: nbval compares it


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize("chart", charts(), ids=lambda c: c.name)
def test_the_charts_script_is_valid_javascript(chart, tmp_path):
    path = tmp_path / f"{chart.name}.js"
    path.write_text(chart.script())
    result = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_chart_refuses_a_spec_that_is_not_json():
    with pytest.raises(TypeError, match="Vega-Lite spec as a dict"):
        explore.Chart("{}", "x")
    with pytest.raises(ValueError):
        explore.Chart({"data": {"values": [{"x": float("nan")}]}}, "x")


def test_the_streaming_table_holds_the_step_models_predictions():
    work, hw = a_streamed_workload(), preset("h100-sxm")
    spans, steps = explore.streaming_table(work, hw, links_gbps=[5.0, 50.0])
    assert len(steps) == 2 * 2 * 5  # links x homes x depths
    slow = hw.replace(link_h2d=5 * GB, link_d2h=5 * GB)
    pred = predict(work, slow, StepConfig(params_on="nvme", prefetch=2, mfu=1.0))
    step = next(s for s in steps if (s["link"], s["home"], s["depth"]) == (0, "nvme", 2))
    assert step["step_ms"] == pytest.approx(pred.step_s * 1e3) and step["exposed"] == pred.exposed_fetch_fraction
    drawn = [s for s in spans if (s["link"], s["home"], s["depth"]) == (0, "nvme", 2)]
    assert len(drawn) == sum(1 for s in pred.trace.spans if s.lane in explore.streaming.LANES) > 0
    assert {s["lane"] for s in drawn} >= {"compute", "h2d", "nvme_read"}
    # a faster link exposes no more of the fetches, at every depth
    for home in ("host", "nvme"):
        for depth in range(5):
            slow_, fast = (next(s for s in steps if (s["link"], s["home"], s["depth"]) == (i, home, depth))
                           for i in (0, 1))
            assert fast["exposed"] <= slow_["exposed"] + 1e-12


def test_the_streaming_chart_starts_at_the_machines_link_and_refuses_a_budget_in_words():
    hw = preset("h100-sxm")
    chart = explore.streaming_chart(a_streamed_workload(), hw, prefetch=2, budget_blocks=4, home="nvme")
    params = {p["name"]: p for p in chart.spec["params"]}
    labels = params["link"]["bind"]["labels"]
    assert labels[params["link"]["value"]] == f"{round(hw.link_h2d / GB, 3):g}"
    assert (params["depth"]["value"], params["budget"]["value"], params["home"]["value"]) == (2, 4, "nvme")
    summary, bars = chart.spec["vconcat"]
    assert "budget >= depth + 1" in bars["transform"][0]["filter"]
    assert "refused" in summary["transform"][1]["calculate"]
    assert f"at most ' + budget + ' x {(7e9 - 1e8) / 32 * 2 / 1e6:.3g} MB" in summary["transform"][1]["calculate"]


@pytest.mark.parametrize(("kwargs", "message"), [({"prefetch": 5}, "prefetch must be 0-4"),
                                                 ({"budget_blocks": 0}, "budget_blocks 1-6"),
                                                 ({"home": "disk"}, "home must be one of")])
def test_the_streaming_chart_refuses_bad_arguments_and_says_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        explore.streaming_chart(a_streamed_workload(), preset("h100-sxm"), **kwargs)
    with pytest.raises(TypeError, match="stepmodel.Workload"):
        explore.streaming_chart("gpt", preset("h100-sxm"))
