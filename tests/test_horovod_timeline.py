"""Reading Horovod's timeline and splitting a step into compute, ring, waits and tail."""
import pytest

from tfoverlap.costs.horovod_timeline import (covered_micros, read_timeline,
                                              step_breakdown)

from helpers import horovod_timeline_text

ORIGIN = 1_000_000


def _timeline(tensors: dict, closed: bool = False) -> str:
    return horovod_timeline_text(tensors, ORIGIN, closed)


def test_a_timeline_gives_each_tensors_phases_on_the_epoch_clock():
    text = _timeline({"grad_a": [("NEGOTIATE_ALLREDUCE", 100, 150), ("ALLREDUCE", 160, 400)],
                      "grad_b": [("NEGOTIATE_ALLREDUCE", 120, 150), ("ALLREDUCE", 161, 400)],
                      "shard_a": [("NEGOTIATE_ALLGATHER", 500, 520), ("ALLGATHER", 530, 600)]})
    for variant in (text, text.rstrip(",") + "]"):      # still being written, or closed
        records = read_timeline(variant)
        assert records["grad_a"].negotiations == [(ORIGIN + 100, ORIGIN + 150)]
        # The nested GLOO_ALLREDUCE is part of the reduction, not a reduction of its own.
        assert records["grad_a"].reductions == [(ORIGIN + 160, ORIGIN + 400)]
        assert records["grad_b"].bytes == 400
        # Each tensor's collective, for a figure of decoupled reduction's two halves.
        assert [records[name].operation for name in ("grad_a", "shard_a")] == [
            "ALLREDUCE", "ALLGATHER"]
        assert records["shard_a"].reductions == [(ORIGIN + 530, ORIGIN + 600)]


@pytest.mark.parametrize("text", [
    "", "{not json", '{"a": 1}',
    '[{"name": "process_name", "pid": 1, "args": {"name": "t"}}, {"ph": "B", "pid": 1}]',
    '[{"name": "process_name", "pid": 1, "args": {"name": "t"}}, '
    '{"ph": "B", "name": "ALLREDUCE", "pid": 1, "ts": "x"}, {"ph": "E", "pid": 1, "ts": 5}]'])
def test_a_corrupt_timeline_is_a_clear_error(text):
    with pytest.raises(ValueError, match="not a Horovod timeline"):
        read_timeline(text)


def test_covered_time_is_the_union_inside_the_window():
    assert covered_micros([(0, 10), (5, 20), (30, 40)], (0, 100)) == 30
    assert covered_micros([(0, 10), (5, 20), (30, 40)], (8, 35)) == 17
    assert covered_micros([], (0, 10)) == 0


def test_a_step_splits_into_compute_and_a_tail_of_ring_waits_and_updates():
    # Step 0-1000 µs: gradients at 200, 500, 700; two fused requests and a late one.
    records = read_timeline(_timeline({
        "a": [("NEGOTIATE_ALLREDUCE", 200, 230), ("ALLREDUCE", 240, 400)],
        "b": [("NEGOTIATE_ALLREDUCE", 500, 520), ("ALLREDUCE", 530, 690)],
        "c": [("NEGOTIATE_ALLREDUCE", 505, 520), ("ALLREDUCE", 531, 690)],
        "d": [("NEGOTIATE_ALLREDUCE", 700, 760), ("ALLREDUCE", 800, 900)],
        # From another step: outside the window, ignored.
        "e": [("NEGOTIATE_ALLREDUCE", 2000, 2010), ("ALLREDUCE", 2020, 2100)]}))
    part = step_breakdown(ORIGIN, ORIGIN + 1000, [ORIGIN + t for t in (200, 500, 505, 700)],
                          records)
    assert part.step == pytest.approx(1e-3)
    assert part.first_gradient == pytest.approx(200e-6)
    assert part.until_last_gradient == pytest.approx(700e-6)
    assert part.tail == pytest.approx(300e-6)
    assert part.tail_ring == pytest.approx(100e-6)          # 800-900
    assert part.tail_wait == pytest.approx(100e-6)          # 700-800: negotiating, waiting
    assert part.after_last_reduction == pytest.approx(100e-6)
    assert part.tail == pytest.approx(part.tail_ring + part.tail_wait
                                      + part.after_last_reduction)
    assert part.ring == pytest.approx((160 + 160 + 100) * 1e-6)
    assert part.ring_idle == pytest.approx((700 - 420) * 1e-6)     # 200-900 minus the ring
    assert part.negotiation == pytest.approx((30 + 20 + 60) * 1e-6)
    assert part.requests == 3                                # b and c reduced together
    # Never idle after the first gradient: 200 + 420 µs of ring, then 100 µs of updates.
    assert part.in_step_bound == pytest.approx(max(700, 200 + 420) * 1e-6 + 100e-6)


def test_a_step_without_gradients_is_a_clear_error():
    with pytest.raises(ValueError, match="no gradient"):
        step_breakdown(ORIGIN, ORIGIN + 1000, [ORIGIN + 5000], {})
    with pytest.raises(ValueError, match="no length"):
        step_breakdown(ORIGIN, ORIGIN, [ORIGIN], {})


def test_the_gradient_timeline_script_says_when_each_quarter_of_the_bytes_was_asked_for():
    """scripts/horovod_gradient_timeline.py's table, per step: when every rank had asked
    for a quarter, half, three quarters and all of the bytes (after the step's first
    request), the ring's busy time and the tail after the last request; emulated ms at
    dilation 2."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "scripts" / "horovod_gradient_timeline.py"
    spec = importlib.util.spec_from_file_location("horovod_gradient_timeline", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    records = read_timeline(horovod_timeline_text({     # 400 bytes each ([10, 10] float32)
        "a": [("NEGOTIATE_ALLREDUCE", 0, 1000), ("ALLREDUCE", 1000, 3000),
              ("NEGOTIATE_ALLREDUCE", 10000, 12000), ("ALLREDUCE", 12000, 13000)],
        "b": [("NEGOTIATE_ALLREDUCE", 500, 4000), ("ALLREDUCE", 4000, 6000),
              ("NEGOTIATE_ALLREDUCE", 10000, 11000), ("ALLREDUCE", 11000, 12000)]},
        ORIGIN, closed=True))
    first, second = script.step_table(records, dilation=2.0)
    assert first["bytes_50pct_ms"] == 0.5 and first["bytes_100pct_ms"] == 2.0
    assert first["ring_busy_ms"] == 2.0 and first["tail_after_last_request_ms"] == 1.0
    assert second["bytes_25pct_ms"] == 0.5 and second["bytes_100pct_ms"] == 1.0
    assert second["ring_busy_ms"] == 1.0 and second["tail_after_last_request_ms"] == 0.5
