"""`agentloop rollout`'s output folder and what an interrupted step records (in-process, a stand-in
runtime, no engine): a non-empty `--out` is refused unless `--overwrite`, and Ctrl-C lists every
prompt of the step with its status, `not_started` included."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import anyio
import pytest

from agentloop.cli import main
from agentloop.commands.rollout_prompts import launched_groups, prompt_statuses
from agentloop.types import Sample, Trajectory
from test_cli import _FakeRuntime


def _data(tmp_path: Path, rows: int) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i}", "prompt": f"q{i}"}) + "\n" for i in range(rows)))
    return data


def test_non_empty_out_is_refused_unless_overwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import agentloop.runtime

    monkeypatch.setattr(agentloop.runtime, "Runtime", _FakeRuntime)
    out = tmp_path / "out"
    base = ["rollout", "--data", str(_data(tmp_path, 4)), "--out", str(out), "-q", "--no-timeline", "--steps", "1"]
    assert main(base) == 0  # a folder that does not exist yet is created
    first = (out / "trajectories.jsonl").read_text()
    (out / "notes.txt").write_text("mine\n")
    _FakeRuntime.launched = []
    # Re-running into it is refused before any engine starts, and nothing is touched.
    assert main([*base, "--prompts-per-step", "2"]) == 2
    err = capsys.readouterr().err
    assert f"output folder {out} is not empty" in err and "--overwrite" in err and "summary.json" in err
    assert _FakeRuntime.launched == []
    assert (out / "trajectories.jsonl").read_text() == first
    # The config file's `overwrite: true` and the flag replace the run's own files, and leave others alone.
    cfg = tmp_path / "run.yaml"
    cfg.write_text("overwrite: true\nprompts_per_step: 2\n")
    assert main([*base, "--config", str(cfg)]) == 0
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 2 * 2 < len(first.splitlines())
    assert main([*base, "--prompts-per-step", "1", "--overwrite"]) == 0
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 2
    assert (out / "notes.txt").read_text() == "mine\n"
    # A file where the folder should be is refused too (exit 2, not a traceback).
    target = tmp_path / "file"
    target.write_text("x")
    assert main([*base[:3], "--out", str(target), "-q"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


class _InterruptedRuntime(_FakeRuntime):
    """Finishes the first prompt's trajectories, stops the second one's second member midway, then
    gets Ctrl-C (a real SIGINT to this process) before the other prompts start; returns what the
    scheduler returns then: the stopped member as a carried partial, the rest carried untouched."""

    async def step(self, samples, on_trajectory=None):  # noqa: ANN001, ANN201
        import dataclasses
        from types import SimpleNamespace

        _FakeRuntime.launched.append(list(samples))
        await anyio.sleep(0.05)  # a real start and wake-up yield long enough for the signal watcher to start
        jobs = [dataclasses.replace(s, group_id=s.uid, index_in_group=i) for s in samples for i in range(2)]
        done = []
        for j in jobs[:3]:
            t = Trajectory(uid=f"{j.group_id}_{j.index_in_group}", group_id=j.group_id, prompt_ids=[1],
                           index_in_group=j.index_in_group)
            done.append(t)
            await on_trajectory(t)
        os.kill(os.getpid(), signal.SIGINT)
        with anyio.fail_after(10):
            while not self.stopped:
                await anyio.sleep(0.01)
        partial = Trajectory(uid=f"{jobs[3].group_id}_1", group_id=jobs[3].group_id, prompt_ids=[1],
                             index_in_group=1, status="aborted")
        carry = [dataclasses.replace(jobs[3], resume_from=partial), *jobs[4:]]
        return SimpleNamespace(trajectories=done, carry_over=carry, rejected=[], metrics={"rollout_seconds": 0.01})

    @property
    def scheduler(self):  # noqa: ANN201
        runtime = self

        class _Stop:
            def stop(self, reason: str) -> None:
                runtime.stopped = True

        return _Stop()

    @scheduler.setter
    def scheduler(self, value) -> None:  # noqa: ANN001
        self.stopped = False


def test_ctrl_c_lists_every_prompt_with_its_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import agentloop.runtime

    monkeypatch.setattr(agentloop.runtime, "Runtime", _InterruptedRuntime)
    out = tmp_path / "out"
    code = main(["rollout", "--data", str(_data(tmp_path, 6)), "--out", str(out), "-q", "--no-timeline",
                 "--steps", "3", "--prompts-per-step", "4", "--n", "2"])
    assert code == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and len(summary["per_step"]) == 1
    step = summary["per_step"][0]
    assert step["prompts"] == {"p0": "completed", "p1": "aborted", "p2": "not_started", "p3": "not_started"}
    assert step["prompt_status"]["not_started"] == 2 and summary["prompt_status"] == step["prompt_status"]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["uid"], r["status"]) for r in rows] == [("p0_0", "completed"), ("p0_1", "completed"),
                                                       ("p1_0", "completed"), ("p1_1", "aborted")]
    printed = capsys.readouterr().out
    assert "prompts: completed 1, aborted 1, not_started 2" in printed and "per_step[].prompts" in printed


def test_prompt_statuses_of_groups_and_carried_members() -> None:
    fresh = [Sample(uid=f"g{i}", messages=[]) for i in range(3)]
    carried = Sample(uid="old_1", messages=[], group_id="old", index_in_group=1)
    launched = launched_groups([carried, *fresh], 4)
    assert launched == {"old": 1, "g0": 4, "g1": 4, "g2": 4}
    trajs = [Trajectory(uid=f"g0_{i}", group_id="g0", prompt_ids=[1], status=s)
             for i, s in enumerate(["completed", "truncated", "completed", "completed"])]
    trajs += [Trajectory(uid=f"g1_{i}", group_id="g1", prompt_ids=[1], status="failed" if i else "completed")
              for i in range(4)]
    trajs.append(Trajectory(uid="old_1", group_id="old", prompt_ids=[1]))
    assert prompt_statuses(launched, trajs) == {"old": "completed", "g0": "truncated", "g1": "failed",
                                                "g2": "not_started"}
    assert prompt_statuses(launched, trajs[:3], carried={"g2"}) == {
        "old": "not_started", "g0": "aborted", "g1": "not_started", "g2": "carried_over"}
