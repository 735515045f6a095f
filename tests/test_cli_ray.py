"""Ray mode from the command line and the config file: `agentloop rollout --ray ...` and `ray:`.

- The flags and the file's `ray:` key (a switch, or the whole `runtime.ray` section) land on
  `RuntimeConfig.ray`; the Ray flags imply `--ray`; conflicts and bad values name where they are.
- A real subprocess `agentloop rollout --ray --ray-workers 2` starts a local Ray (2 CPUs), runs the
  shipped tiny tool model's two steps through `RayRuntime` and writes the same outputs as local mode
  (checked like tests/test_cli_rollout.py does), every trajectory run by one of the two worker actors.
- SIGTERM in the middle of a Ray run stops it like a local one (exit 130, partial trajectories written).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
from pathlib import Path

import pytest

from agentloop.commands.rollout_args import add_parser, overrides_from_args
from agentloop.data import arithmetic_prompts
from agentloop.config.rollout import ConfigError, defaults_yaml, load_config
from test_cli_rollout import check_outputs, rollout_cmd, run_rollout, signal_mid_step


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["rollout", *argv])


def config_from(*argv: str, path: Path | None = None):
    return load_config(path, overrides_from_args(parse(*argv)))


def test_ray_is_off_by_default_and_documented() -> None:
    cfg = config_from()
    assert cfg.runtime.ray.enabled is False and cfg.runtime.ray.address is None
    shown = defaults_yaml()
    prose = re.sub(r"\n\s*# ", " ", shown)  # the comments' text, unwrapped
    assert "  ray:\n" in shown and "Flag: --ray." in prose and "Flag: --ray-address." in prose
    assert shown.count("num_workers: 2") == 1


def test_ray_flags_set_the_ray_section() -> None:
    rc = config_from("--ray").runtime.ray
    assert rc.enabled and rc.address is None and rc.num_workers == 2
    rc = config_from("--ray-address", "auto", "--ray-workers", "4").runtime.ray
    assert (rc.enabled, rc.address, rc.num_workers) == (True, "auto", 4)  # Ray settings typed = Ray mode
    rc = config_from("--ray-address", "ray://head:10001", "--set", "runtime.ray.enabled=false").runtime.ray
    assert not rc.enabled and rc.address == "ray://head:10001"  # an explicit `enabled` wins
    rc = config_from("--ray", "--set", "runtime.ray.init_kwargs={num_cpus: 2}").runtime.ray
    assert rc.init_kwargs == {"num_cpus": 2}
    with pytest.raises(ConfigError, match=r"--ray-workers: runtime\.ray\.num_workers: Input should be greater"):
        config_from("--ray-workers", "0")


def test_the_file_says_it_in_the_ray_section(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("steps: 1\nruntime:\n  ray: {enabled: true, address: auto, engine_num_cpus: 0.5}\n  scheduler: {n: 3}\n")
    cfg = load_config(f)
    assert (cfg.runtime.ray.enabled, cfg.runtime.ray.address, cfg.runtime.ray.engine_num_cpus) == (True, "auto", 0.5)
    assert cfg.runtime.scheduler.n == 3
    # The flags override the file.
    rc = load_config(f, overrides_from_args(parse("--ray-workers", "1"))).runtime.ray
    assert rc.num_workers == 1 and rc.enabled


@pytest.mark.parametrize("text, pattern", [
    # The older spellings: the flags' names at the top level of the file.
    ("ray: true\n", r"{f}:1:1: ray: `ray` is the flag --ray; in the file write it as runtime\.ray\.enabled"),
    ("ray_workers: 3\n", r"{f}:1:1: ray_workers: `ray_workers` is the flag --ray-workers; in the file write it as "
     r"runtime\.ray\.num_workers"),
    ("ray: {enabled: true}\n", r"{f}:1:1: ray: `ray` is the flag --ray; in the file write it as runtime\.ray\.enabled"),
    ("steps: 1\nruntime:\n  ray:\n    enabled: true\n    num_wrokers: 2\n", r"{f}:5:5: runtime\.ray\.num_wrokers: unknown field"),
    ("runtime:\n  ray:\n    placement_strategy: FILL\n", r"{f}:3:25: runtime\.ray\.placement_strategy: Input should be"),
    ("runtime:\n  ray: {enabled: yes please}\n", r"{f}:2:18: runtime\.ray\.enabled: Input should be a valid boolean"),
])
def test_bad_ray_settings_name_the_field_and_the_line(tmp_path: Path, text: str, pattern: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=pattern.format(f=f)):
        load_config(f)


@pytest.mark.slow
def test_rollout_on_a_local_ray_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(arithmetic_prompts().read_text().splitlines()[:6]) + "\n")
    out = tmp_path / "out"
    res = run_rollout(
        "--ray", "--ray-workers", "2", "--steps", "2", "--data", str(data), "--out", str(out),
        "--prompts-per-step", "3", "--n", "2", "--quiet", "--max-new-tokens", "32",
        # A local Ray of 2 CPUs without its dashboard: the 2-core CI machine starts it in seconds.
        "--set", "runtime.ray.init_kwargs={num_cpus: 2, include_dashboard: false, log_to_driver: false}",
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    assert "starting Ray mode (a local Ray; 2 rollout workers)" in res.stderr
    rows = check_outputs(out, steps=2)
    assert len(rows) == 2 * 3 * 2 and [r["step"] for r in rows].count(1) == 6
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["index_in_group"])
    assert len(groups) == 6 and all(sorted(v) == [0, 1] for v in groups.values())
    # Every trajectory ran on a Ray worker actor, and both workers got work.
    assert {r["extra"]["worker"] for r in rows} == {0, 1}
    assert all(r["extra"]["servers"] for r in rows) and all("expected_calls" in r["extra"] for r in rows)
    # The tiny model calls the calculator through the workers' tools, as in local mode.
    assert sum(r["tool_calls"] for r in rows) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"]["status"]["failed"] == 0 and summary["engines"] and len(summary["per_step"]) == 2
    assert "done: 12 trajectories in 2 step(s)" in res.stdout


@pytest.mark.slow
def test_sigterm_stops_a_ray_run_cleanly(tmp_path: Path) -> None:
    # ray.init sets SIGTERM to sys.exit; RayRuntime puts the command's own handler back, so SIGTERM
    # still aborts in flight, puts the engines to sleep and writes the partial trajectories.
    pytest.importorskip("ray")
    out = tmp_path / "out"
    rc, seen, stdout, stderr = signal_mid_step(
        rollout_cmd("--ray", "--steps", "5", "--out", str(out), "--prompts-per-step", "8", "--n", "2", "--quiet",
                    "--max-new-tokens", "64", "--set", "runtime.ray.init_kwargs={num_cpus: 2, include_dashboard: false}"),
        signal.SIGTERM)
    assert rc == 130, seen + stderr
    assert "SIGTERM: stopping" in stderr and "interrupted:" in stdout
    steps = len(json.loads((out / "summary.json").read_text())["per_step"])
    assert 1 <= steps < 5
    rows = check_outputs(out, steps=steps, interrupted=True)
    assert any(r["status"] == "aborted" for r in rows if r["step"] == steps)
