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


def test_stage_times_in_the_title_every_stage_in_the_legend_unfinished_rows_marked() -> None:
    """On the CPU engine the stages take milliseconds of a one-second step: their bands cannot be
    seen, so each panel's title (above the rows, not over them) carries each stage's time and the
    legend lists every stage; aborted and failed trajectories get their own legend entries."""
    from agentloop.engine.lifecycle import StageRecord
    from agentloop.output.timeline import _phase_marks, legend_entries, panel_title

    trajs = [make_traj(f"c#{i}", t0=10.0 + 0.5 * i) for i in range(4)]  # a step of about 2 s
    trajs[1].status = "aborted"
    end = max(e.end for t in trajs for e in t.timeline)
    records = [StageRecord("wake_up", "resume_weights", 9.980, 9.9931), StageRecord("wake_up", "update_weights", 9.9931, 9.9990),
               StageRecord("wake_up", "resume_kv_cache", 9.9990, 9.9995),
               StageRecord("sleep", "pause", end + 0.001, end + 0.008), StageRecord("sleep", "release", end + 0.008, end + 0.0102)]
    step = StepTimeline(1, trajs, records)
    marks = {phase: text for phase, _, _, text in _phase_marks(records, 9.98)}
    assert marks["wake_up"] == "awake after wake-up 19 ms (resume_weights 13 · update_weights 6 · resume_kv_cache 0 ms)"
    assert marks["sleep"] == "sleep 9 ms (pause 7 · release 2 ms)"
    title = panel_title(step)
    assert title.splitlines() == ["step 1: 4 trajectories (3 completed, 1 aborted)",
                                  f"{marks['wake_up']}   |   {marks['sleep']}"]
    labels = [label for _, label, _ in legend_entries([step])]
    # Every wake-up stage, not only the ones wide enough to see.
    assert {"wake-up: resume_weights", "wake-up: update_weights", "wake-up: resume_kv_cache",
            "sleep: pause", "sleep: release"} <= set(labels)
    assert "aborted (×)" in labels and "failed (×)" not in labels
    assert {"engine awake", "sleep begins", "generate", "tool"} <= set(labels)
    slow = [StageRecord("wake_up", "update_weights", 7.0, 9.99), *records[3:]]
    assert _phase_marks(slow, 7.0)[0][3] == "awake after wake-up 2.99 s (update_weights 2.99 s)"


def test_training_plot_from_step_results(tmp_path: Path) -> None:
    """training.png from a trainer's StepResults: reward mean/std, groups with differing rewards,
    response length, tool calls, status counts and tokens/s per step."""
    from agentloop.output.training_plot import StepStats, plot_training, step_stats
    from agentloop.runtime.types import StepResult

    results = []
    for step in (1, 2, 3):
        trajs = [make_traj(f"g{step}{g}#{i}", t0=10.0 * step) for g in range(2) for i in range(2)]
        for i, t in enumerate(trajs):
            t.reward = 1.0 if i < step else 0.0  # step 1: one group differs; step 3: the other is all-right
        trajs[-1].status = "aborted" if step == 2 else "completed"
        results.append(StepResult(step=step, weight_version=f"v{step}", trajectories=trajs, batch=None,  # type: ignore[arg-type]
                                  metrics={"rollout_seconds": 2.0}))
    stats = [StepStats.from_result(r) for r in results]
    assert [s.reward_mean for s in stats] == [0.25, 0.5, 0.75]
    assert stats[0].reward_std == pytest.approx(0.4330127)
    assert [s.varied_groups for s in stats] == [0.5, 0.0, 0.5]
    assert stats[1].status["aborted"] == 1 and stats[1].status["completed"] == 3
    assert stats[0].tokens_per_second == 4 * 5 / 2.0  # 5 sampled tokens per trajectory over 2 s
    assert stats[0].response_tokens_mean == 7 and stats[0].tool_calls_mean == 1
    assert step_stats(4, []).reward_mean is None
    path = plot_training(results, tmp_path / "training.png")
    w, h = png_size(path)
    assert w > 800 and h > 500
    with pytest.raises(ValueError):
        plot_training([], tmp_path / "x.png")
