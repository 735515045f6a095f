"""`agentloop config` and the settings/data side of `agentloop rollout` (in-process, no engine needed)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentloop.cli import build_parser, main
from agentloop.commands.rollout_prompts import step_prompts
from agentloop.output.progress import RolloutProgress
from agentloop.config.rollout import ConfigError, RolloutConfig, defaults_yaml, load_config
from agentloop.types import Sample


def test_config_show_is_documented_and_loads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--show"]) == 0
    text = capsys.readouterr().out
    assert text == defaults_yaml()
    # Every field of every level is there with a comment line above it.
    lines = text.splitlines()
    for key in ("steps:", "on_bad_row:", "  engine:", "    urls:", "    concurrency:", "    n:", "    max_new_tokens_per_turn:"):
        i = next(i for i, line in enumerate(lines) if line.startswith(key))
        assert lines[i - 1].lstrip().startswith("# "), key
    f = tmp_path / "defaults.yaml"
    f.write_text(text)
    assert load_config(f) == RolloutConfig()
    assert main(["config", "--check", str(f)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["runtime"]["scheduler"]["n"] == 2


def test_python_dash_m_agentloop_runs_the_cli(tmp_path: Path) -> None:
    """`python -m agentloop ...` is the same command as the `agentloop` script (exit status included)."""
    show = subprocess.run([sys.executable, "-m", "agentloop", "config", "--show"], capture_output=True, text=True,
                          timeout=60)
    assert show.returncode == 0, show.stderr
    assert show.stdout == defaults_yaml()
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 2\n")
    check = subprocess.run([sys.executable, "-m", "agentloop", "config", "--check", str(bad)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 2 and f"{bad}:1:1: stepz: unknown field" in check.stderr


def test_bad_config_names_field_and_position(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("steps: 2\nruntime:\n  scheduler:\n    concurrency: lots\n  agent:\n    temprature: 0.5\n")
    assert main(["rollout", "--config", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{f}:4:18: runtime.scheduler.concurrency: Input should be a valid integer" in err
    assert f"{f}:6:5: runtime.agent.temprature: unknown field" in err
    assert not (tmp_path / "out").exists()


def test_yaml_syntax_error_and_non_mapping(tmp_path: Path) -> None:
    f = tmp_path / "broken.yaml"
    f.write_text("steps: 2\nruntime: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{f}:3:1: invalid YAML"):
        load_config(f)
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_flags_override_file_and_errors_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("steps: 5\nruntime:\n  scheduler:\n    concurrency: 3\n")
    cfg = load_config(f, {"steps": (1, "--steps"), "runtime.scheduler.n": (4, "--n")})
    assert cfg.steps == 1 and cfg.runtime.scheduler.n == 4
    assert cfg.runtime.scheduler.concurrency == 3  # from the file
    # Nested keys merge over the rollout's runtime defaults instead of replacing them.
    assert cfg.runtime.agent.max_new_tokens_per_turn == RolloutConfig().runtime.agent.max_new_tokens_per_turn
    assert main(["rollout", "--config", str(f), "--n", "0"]) == 2
    assert "--n: runtime.scheduler.n: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["rollout", "--set", "runtime.scheduler.nope=1"]) == 2
    assert "--set runtime.scheduler.nope: runtime.scheduler.nope: unknown field" in capsys.readouterr().err
    assert main(["rollout", "--set", "steps"]) == 2
    assert "expected FIELD=VALUE" in capsys.readouterr().err


def test_config_file_refuses_the_flags_names_at_top_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The file takes the nested layout only; a flag's name at its top level (an older spelling) is an
    # error at that key, naming the flag and the field to write instead.
    f = tmp_path / "flat.yaml"
    f.write_text("steps: 3\nn: 4\nengine-url: [http://a:1]\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert f"{f}:2:1: n: `n` is the flag --n; in the file write it as runtime.scheduler.n" in str(e.value)
    assert (f"{f}:3:1: engine-url: `engine-url` is the flag --engine-url; in the file write it as "
            "runtime.engine.urls") in str(e.value)
    assert main(["config", "--check", str(f)]) == 2
    assert "write it as runtime.scheduler.n" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--set n: n: `n` is the flag --n; in the file write it as runtime.scheduler.n"):
        load_config(None, {"n": (5, "--set n")})
    # The nested layout: every flag's field, and flags override the file.
    nested = tmp_path / "nested.yaml"
    nested.write_text("steps: 3\nprompts_per_step: 5\ndata: d.jsonl\nout: o\nruntime:\n  scheduler: {n: 4, concurrency: 8}\n"
                      "  engine: {urls: [http://a:1, http://b:2], model: /m}\n"
                      "  agent: {max_new_tokens_per_turn: 40, sampling: {temperature: 0.5, seed: 7}}\n")
    cfg = load_config(nested)
    assert (cfg.runtime.scheduler.n, cfg.runtime.scheduler.concurrency) == (4, 8)
    assert cfg.runtime.engine.urls == ["http://a:1", "http://b:2"] and cfg.runtime.engine.model == "/m"
    assert (cfg.steps, cfg.prompts_per_step, cfg.data, cfg.out) == (3, 5, "d.jsonl", "o")
    agent = cfg.runtime.agent
    assert (agent.max_new_tokens_per_turn, agent.sampling.temperature, agent.sampling.seed) == (40, 0.5, 7)
    assert agent.max_assistant_turns == RolloutConfig().runtime.agent.max_assistant_turns  # the rest kept
    assert load_config(nested, {"runtime.scheduler.n": (6, "--n")}).runtime.scheduler.n == 6
    nested.write_text("steps: 1\nruntime:\n  scheduler:\n    n: 0\n")
    with pytest.raises(ConfigError, match=rf"{nested}:4:8: runtime.scheduler.n: Input should be greater than or equal to 1 \(got 0\)"):
        load_config(nested)
    # A real typo is still an unknown field.
    f.write_text("concurency: 3\n")
    with pytest.raises(ConfigError, match=rf"{f}:1:1: concurency: unknown field"):
        load_config(f)
    # `config --show` tells which flag sets a field.
    shown = " ".join(line.strip().lstrip("#").strip() for line in defaults_yaml().splitlines())  # unwrapped
    assert "Flag: --n." in shown and "top-level `n:`" not in shown


def test_config_show_marks_the_commands_own_runtime_defaults() -> None:
    """ROLLOUT_RUNTIME_DEFAULTS (the command's n, concurrency, turn limits, engine threads) are marked in
    `config --show` with the library's value beside them; fields the command leaves alone are not."""
    from agentloop.config import RuntimeConfig
    from agentloop.config.rollout import ROLLOUT_RUNTIME_DEFAULTS

    shown = " ".join(line.strip().lstrip("#").strip() for line in defaults_yaml().splitlines())
    library = RuntimeConfig()
    for section, values in ROLLOUT_RUNTIME_DEFAULTS.items():
        for name in values:
            lib = getattr(getattr(library, section), name)
            lib_text = "[]" if lib == [] else str(lib)
            assert f"agentloop rollout's default; the library's (Runtime) is {lib_text}." in shown, (section, name)
    assert shown.count("agentloop rollout's default;") == sum(len(v) for v in ROLLOUT_RUNTIME_DEFAULTS.values())


def test_rollout_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rollout", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--engine-url URL" in out and "(default: 2; config field: steps)" in out
    assert "config field: runtime.scheduler.n" in out


def test_engine_url_takes_several_urls_per_flag_or_repeated() -> None:
    from agentloop.commands.rollout_args import overrides_from_args

    parser = build_parser()
    one_flag = parser.parse_args(["rollout", "--engine-url", "http://a:1", "http://b:2", "--steps", "1"])
    repeated = parser.parse_args(["rollout", "--engine-url", "http://a:1", "--engine-url", "http://b:2", "http://c:3"])
    assert one_flag.engine_url == ["http://a:1", "http://b:2"] and one_flag.steps == 1
    assert repeated.engine_url == ["http://a:1", "http://b:2", "http://c:3"]
    cfg = load_config(None, overrides_from_args(one_flag))
    assert cfg.runtime.engine.urls == ["http://a:1", "http://b:2"]
    assert parser.parse_args(["rollout"]).engine_url is None  # no flag: the config file's urls stay
    assert parser.parse_args(["rollout", "-q"]).quiet is True
    assert load_config(None, overrides_from_args(parser.parse_args(["rollout", "-q"]))).quiet is True


def test_bad_rows_stop_or_skip_before_any_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 2?"}) + "\n{oops\n" + json.dumps({"prompt": ""}) + "\n")
    out = tmp_path / "out"
    assert main(["rollout", "--data", str(data), "--out", str(out), "--on-bad-row", "stop"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: invalid JSON" in err
    assert not out.exists()  # nothing was started, nothing written
    # An unknown agent loop is a bad row too (checked against the registry before the run).
    data.write_text(json.dumps({"prompt": "x", "agent": "no_such_loop"}) + "\n")
    assert main(["rollout", "--data", str(data), "--out", str(out)]) == 2
    assert f"{data}:1: agent: unknown agent loop 'no_such_loop'" in capsys.readouterr().err


def test_step_prompts_wrap_and_keep_uids_unique() -> None:
    samples = [Sample(uid=f"p{i}", messages=[{"role": "user", "content": str(i)}]) for i in range(5)]
    s1 = step_prompts(samples, 1, 3)
    s2 = step_prompts(samples, 2, 3)
    assert [s.uid for s in s1] == ["p0", "p1", "p2"]
    assert [s.uid for s in s2] == ["p3", "p4", "p0@1"]
    assert s2[2].messages == samples[0].messages and samples[0].uid == "p0"
    assert [s.uid for s in step_prompts(samples, 2, None)] == [f"p{i}@1" for i in range(5)]


def test_quiet_progress_writes_plain_lines() -> None:
    from test_output import make_traj

    buf = io.StringIO()
    with RolloutProgress(quiet=True, stream=buf, log_every=3600) as p:
        p.begin_step(1, 2, 3)
        for i in range(3):
            p.trajectory_done(make_traj(f"a#{i}", status="failed" if i == 1 else "completed"))
        p.end_step({"status": {"completed": 2, "failed": 1}, "tool_calls": 3, "tokens_per_second": 10.0,
                    "seconds": {"wake_up": 0.5, "sleep": 0.25}})
    lines = buf.getvalue().splitlines()
    assert "step 1/2: rolling out 3 trajectories" in lines[0]
    # First and last trajectory are logged (rate-limited in between), with counts.
    assert "step 1/2: 1/3 done" in lines[1] and "3/3 done" in lines[2] and "1 errors" in lines[2]
    assert "2 completed" in lines[3] and "wake-up 0.500s, sleep 0.250s" in lines[3]
    assert "\x1b[" not in buf.getvalue()  # no terminal escapes in log mode


class _FakeRuntime:
    """Stands in for `agentloop.runtime.Runtime` to see which prompts `agentloop rollout` launches each
    step. It plays the scheduler's over-sampling contract: with `target_groups`, the first that many
    groups complete and the others come back as carry-over samples (group_id set)."""

    launched: list[list[Sample]] = []

    def __init__(self, config) -> None:  # noqa: ANN001
        from types import SimpleNamespace

        self.config = config
        self.lifecycle = SimpleNamespace(urls=["http://fake:1"], records=[])
        self.scheduler = None
        self.processes: list = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def step(self, samples, on_trajectory=None):  # noqa: ANN001, ANN201
        import dataclasses
        from types import SimpleNamespace

        from agentloop.types import Trajectory

        _FakeRuntime.launched.append(list(samples))
        n, target = self.config.scheduler.n, self.config.scheduler.target_groups
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            if s.group_id:
                groups.setdefault(s.group_id, []).append(s)
            else:
                groups[s.uid] = [dataclasses.replace(s, group_id=s.uid, index_in_group=i) for i in range(n)]
        done, carry = [], []
        for k, (gid, members) in enumerate(groups.items()):
            if target is not None and k >= target:
                carry.extend(members)
                continue
            for m in members:
                t = Trajectory(uid=f"{gid}_{m.index_in_group}", group_id=gid, prompt_ids=[1],
                               index_in_group=m.index_in_group)
                done.append(t)
                await on_trajectory(t)
        return SimpleNamespace(trajectories=done, carry_over=carry, rejected=[], metrics={"rollout_seconds": 0.01})


def test_rollout_over_samples_target_groups_and_carries_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With target_groups, each step launches ceil(target_groups x oversample_factor) groups, the
    previous step's carried-over groups among them, and fresh rows continue where the last step stopped."""
    import agentloop.runtime

    monkeypatch.setattr(agentloop.runtime, "Runtime", _FakeRuntime)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i}", "prompt": f"q{i}"}) + "\n" for i in range(10)))
    out = tmp_path / "out"
    base = ["rollout", "--data", str(data), "--out", str(out), "--n", "2", "-q", "--no-timeline"]
    _FakeRuntime.launched = []
    assert main([*base, "--steps", "3", "--set", "runtime.scheduler.target_groups=2",
                 "--set", "runtime.scheduler.oversample_factor=1.5"]) == 0
    launched = [[s.group_id or s.uid for s in step] for step in _FakeRuntime.launched]
    # ceil(2 x 1.5) = 3 groups a step: p0-p2; then carried p2 (both members) + p3, p4; then p4 + p5, p6.
    assert [list(dict.fromkeys(g)) for g in launched] == [["p0", "p1", "p2"], ["p2", "p3", "p4"], ["p4", "p5", "p6"]]
    assert launched[1][:2] == ["p2", "p2"] and all(s.group_id for s in _FakeRuntime.launched[1][:2])
    summary = json.loads((out / "summary.json").read_text())
    assert [s["trajectories"] for s in summary["per_step"]] == [4, 4, 4]  # target_groups x n each step
    # Without target_groups: prompts_per_step fresh rows a step, nothing carried.
    _FakeRuntime.launched = []
    assert main([*base, "--steps", "2", "--prompts-per-step", "4", "--overwrite"]) == 0
    assert [[s.uid for s in step] for step in _FakeRuntime.launched] == [["p0", "p1", "p2", "p3"],
                                                                        ["p4", "p5", "p6", "p7"]]


def test_small_dataset_wrapping_is_said_once_and_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """3 rows, 4 prompts a step for 2 steps: rows are reused (uid@lap), said once before the run on
    stderr and recorded in summary.json's data_use; a dataset that suffices says nothing."""
    import agentloop.runtime

    monkeypatch.setattr(agentloop.runtime, "Runtime", _FakeRuntime)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i}", "prompt": f"q{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    base = ["rollout", "--data", str(data), "--out", str(out), "--n", "2", "-q", "--no-timeline"]
    _FakeRuntime.launched = []
    assert main([*base, "--steps", "2", "--prompts-per-step", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("agentloop rollout: note: the data has 3 row(s)") == 1
    assert "draw up to 8: rows are reused in order, wrapping around, up to 3 times each" in err
    assert "4 prompts per step > 3 rows, so each step repeats rows within itself" in err
    assert [[s.uid for s in step] for step in _FakeRuntime.launched] == [["p0", "p1", "p2", "p0@1"],
                                                                        ["p1@1", "p2@1", "p0@2", "p1@2"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_use"] == {"rows": 3, "prompts_drawn": 8, "laps": 3, "wrapped": True}
    assert main([*base, "--steps", "1", "--prompts-per-step", "3", "--overwrite"]) == 0
    assert "note:" not in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_use"] == {"rows": 3, "prompts_drawn": 3, "laps": 1, "wrapped": False}
