"""timeline.png: a real PNG with one panel per step, trajectories as rows, lifecycle stages as bands."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop.output.timeline import StepTimeline, plot_timeline

from test_output import RECORDS, make_traj

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_two_step_timeline_png(tmp_path: Path) -> None:
    step1 = [make_traj(f"a#{i}", t0=100.0 + 0.05 * i) for i in range(6)]
    step1[2].status = "failed"
    step2 = [make_traj(f"b#{i}", t0=300.0 + 0.05 * i) for i in range(6)]
    rec2 = [type(r)(r.phase, r.stage, r.start + 200, r.end + 200) for r in RECORDS]
    one = plot_timeline([StepTimeline(1, step1, RECORDS)], tmp_path / "one.png")
    two = plot_timeline([StepTimeline(1, step1, RECORDS), StepTimeline(2, step2, rec2)], tmp_path / "two.png")
    w1, h1 = png_size(one)
    w2, h2 = png_size(two)
    assert w1 == w2 and h2 > h1  # a second panel below the first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.png", "two.png"]  # no temp files left


def test_timeline_draws_many_rows_and_empty_steps(tmp_path: Path) -> None:
    many = [make_traj(f"u{i}#0", t0=10.0 + 0.01 * i) for i in range(300)]
    png_size(plot_timeline([StepTimeline(1, many, []), StepTimeline(2, [], RECORDS)], tmp_path / "t.png"))


def test_timeline_needs_a_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_timeline([], tmp_path / "t.png")


def test_stages_too_narrow_to_see_are_labelled_with_their_times() -> None:
    """On the CPU engine the stages take milliseconds of a one-second step: their bands cannot be
    seen, so the awake/sleep labels carry each stage's time and the legend lists only wide bands."""
    from agentloop.engine.lifecycle import StageRecord
    from agentloop.output.timeline import _phase_marks, readable_stages

    trajs = [make_traj(f"c#{i}", t0=10.0 + 0.5 * i) for i in range(4)]  # a step of about 2 s
    end = max(e.end for t in trajs for e in t.timeline)
    records = [StageRecord("wake_up", "resume_weights", 9.980, 9.9931), StageRecord("wake_up", "update_weights", 9.9931, 9.9990),
               StageRecord("sleep", "pause", end + 0.001, end + 0.008), StageRecord("sleep", "release", end + 0.008, end + 0.0102)]
    step = StepTimeline(1, trajs, records)
    assert readable_stages(step) == set()
    marks = {phase: text for phase, _, _, text in _phase_marks(records, 9.98)}
    assert marks["wake_up"] == "awake (wake-up 19 ms)\nresume_weights 13 · update_weights 6 ms"
    assert marks["sleep"] == "sleep 9 ms\npause 7 · release 2 ms"
    # A weight load of seconds (a GPU server) is a band of its own, in the legend.
    slow = [StageRecord("wake_up", "update_weights", 7.0, 9.99), *records[2:]]
    assert readable_stages(StepTimeline(1, trajs, slow)) == {("wake_up", "update_weights")}
    assert _phase_marks(slow, 7.0)[0][3] == "awake (wake-up 2.99 s)\nupdate_weights 2.99 s"
