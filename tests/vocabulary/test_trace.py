"""Trace summaries agree with hand-computed answers; the Chrome export follows the trace-event format."""

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minioffload.trace import LANE_ORDER, Span, Trace


def make_trace(*spans: tuple) -> Trace:
    trace = Trace()
    for span in spans:
        trace.record(*span)
    return trace


def test_busy_counts_overlapping_spans_on_one_lane_once():
    trace = make_trace(("h2d", "a", 0.0, 2.0), ("h2d", "b", 1.0, 3.0), ("h2d", "c", 5.0, 6.0),
                       ("compute", "k", 0.0, 10.0))
    assert trace.busy("h2d") == pytest.approx(4.0)  # [0, 3] and [5, 6]
    assert trace.busy("compute") == pytest.approx(10.0)
    assert trace.busy("d2h") == 0.0
    assert trace.busiest_lane() == ("compute", pytest.approx(10.0))


def test_makespan_runs_from_the_first_start_to_the_last_end():
    assert Trace().makespan() == 0.0
    trace = make_trace(("compute", "k", 2.0, 3.0), ("d2h", "out", 4.0, 4.5), ("h2d", "in", 1.5, 2.0))
    assert trace.makespan() == pytest.approx(3.0)


@pytest.mark.parametrize("spans, expected", [
    ([("h2d", "a", 0.0, 1.0), ("compute", "b", 1.0, 2.0), ("d2h", "c", 2.0, 3.0)], 0.0),  # serial
    ([("h2d", "a", 0.0, 2.0), ("compute", "b", 0.0, 2.0)], 1.0),  # fully overlapped
    ([("h2d", "a", 0.0, 2.0), ("compute", "b", 1.0, 2.0)], 0.5),  # 1 s of 2 s busy has both lanes
    ([("h2d", "a", 0.0, 2.0), ("compute", "b", 1.0, 3.0)], 1 / 3),
    ([("h2d", "a", 0.0, 2.0), ("h2d", "b", 0.0, 2.0)], 0.0),  # one lane overlapping itself is not overlap
    ([("h2d", "a", 0.0, 1.0), ("compute", "b", 3.0, 4.0)], 0.0),  # idle gaps count for nothing
    ([], 0.0),
])
def test_overlap_fraction(spans, expected):
    assert make_trace(*spans).overlap_fraction() == pytest.approx(expected)


def test_bandwidth_is_bytes_over_busy_time():
    trace = make_trace(("h2d", "a", 0.0, 0.5, 10**9), ("h2d", "b", 0.25, 1.0, 10**9),
                       ("h2d", "c", 2.0, 2.5, 10**9))
    assert trace.bandwidth("h2d") == pytest.approx(3e9 / 1.5)
    assert trace.bandwidth("compute") == 0.0


def test_lanes_follow_lane_order_then_first_appearance():
    trace = make_trace(("zeta", "z", 0, 1), ("nvme_write", "w", 0, 1), ("alpha", "a", 0, 1),
                       ("h2d", "in", 0, 1), ("zeta", "z2", 1, 2), ("host", "h", 0, 1))
    assert trace.lanes() == ["host", "h2d", "nvme_write", "zeta", "alpha"]
    assert LANE_ORDER[:2] == ("host", "h2d")


def test_record_refuses_a_span_that_ends_before_it_starts():
    trace = make_trace(("h2d", "ok", 0.0, 1.0))
    with pytest.raises(ValueError, match="'bad' on 'compute' needs finite start <= end"):
        trace.record("compute", "bad", 2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        trace.record("compute", "nan", float("nan"), 1.0)
    with pytest.raises(ValueError, match="cannot move -1 bytes"):
        trace.record("h2d", "negative", 0.0, 1.0, nbytes=-1)
    assert trace.spans == [Span("h2d", "ok", 0.0, 1.0)]
    assert trace.record("compute", "instant", 1.0, 1.0).duration == 0.0  # zero length is allowed


def test_span_context_manager_records_even_when_the_body_raises():
    trace = Trace()
    with trace.span("cpu", "fine", nbytes=8):
        pass
    with pytest.raises(RuntimeError, match="boom"), trace.span("cpu", "fails"):
        raise RuntimeError("boom")
    assert [s.name for s in trace.spans] == ["fine", "fails"]
    assert trace.spans[0].nbytes == 8
    assert all(0 <= s.start <= s.end for s in trace.spans)


def test_clear_empties_the_trace():
    trace = make_trace(("h2d", "a", 0.0, 1.0))
    trace.clear()
    assert trace.spans == [] and trace.lanes() == [] and trace.makespan() == 0.0


def test_recording_from_many_threads_loses_nothing():
    trace = Trace()

    def worker(k: int) -> None:
        for i in range(1000):
            trace.record(f"lane{k}", f"op{i}", i, i + 0.5, 1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(trace.spans) == 8000
    assert sorted(trace.lanes()) == [f"lane{k}" for k in range(8)]
    assert all(len(trace.on(f"lane{k}")) == 1000 for k in range(8))


# Chrome / Perfetto export ------------------------------------------------------------------------

def test_chrome_export_follows_the_trace_event_format():
    trace = make_trace(("compute", "fwd", 0.001, 0.004), ("h2d", "in", 0.0, 0.002, 4096),
                       ("mystery", "x", 0.003, 0.003))
    doc = json.loads(json.dumps(trace.to_chrome()))  # JSON-serialisable, and survives the round trip
    events = doc["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= event.keys()
        assert event["ph"] in ("X", "M")

    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted(trace.lanes())  # exactly one per lane
    assert len([e for e in events if e["name"] == "thread_name"]) == len(trace.lanes())

    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(trace.spans)
    for event in complete:
        assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float))
        assert event["dur"] >= 0
        span = next(s for s in trace.spans if s.name == event["name"])
        assert threads[event["tid"]] == span.lane
        assert event["ts"] == pytest.approx(span.start * 1e6)  # microseconds
        assert event["dur"] == pytest.approx(span.duration * 1e6)
        assert event["args"]["bytes"] == span.nbytes


def test_save_writes_the_chrome_json(tmp_path):
    trace = make_trace(("h2d", "in", 0.0, 0.002, 4096), ("compute", "fwd", 0.001, 0.004))
    path = trace.save(tmp_path / "step.json")
    assert path == tmp_path / "step.json"
    assert json.loads(path.read_text()) == trace.to_chrome()


# properties -------------------------------------------------------------------------------------

def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length covered by `intervals`, by merging them left to right (written apart from trace.py's)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(end - start for start, end in merged)


spans_strategy = st.lists(
    st.tuples(st.sampled_from(["h2d", "compute", "d2h", "cpu"]),
              st.floats(0, 100, allow_nan=False), st.floats(0, 20, allow_nan=False)),
    min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(spans_strategy)
def test_summaries_are_consistent_for_any_spans(raw):
    trace = make_trace(*[(lane, f"s{i}", start, start + length)
                         for i, (lane, start, length) in enumerate(raw)])
    tolerance = 1e-9 * (1 + trace.makespan())
    assert 0.0 <= trace.overlap_fraction() <= 1.0
    union = union_length([(s.start, s.end) for s in trace.spans])
    assert union <= trace.makespan() + tolerance
    for lane in trace.lanes():
        assert 0.0 <= trace.busy(lane) <= trace.makespan() + tolerance
    assert sum(trace.busy(lane) for lane in trace.lanes()) >= union - tolerance


def test_spans_overlap_when_they_share_time_not_when_they_touch():
    a = Span("h2d", "a", 0.0, 1.0)
    assert a.overlaps(Span("compute", "b", 0.5, 2.0)) and Span("compute", "b", 0.5, 2.0).overlaps(a)
    assert not a.overlaps(Span("compute", "c", 1.0, 2.0))  # touching ends
    assert a.overlaps(Span("cpu", "d", 0.2, 0.3))  # inside
