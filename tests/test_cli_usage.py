"""What a user typing the `agentloop` command gets wrong, and what it tells them (no engine runs):
a mistyped flag (the subcommand's usage and the flag it probably meant), an engine URL without a
scheme (accepted) or not an http URL (exit 2, saying what is expected), a missing `--model` folder
(exit 2 before anything starts), `agentloop serve` on a busy port (a message, no traceback)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.cli import main
from agentloop.config import RuntimeConfig


def test_a_mistyped_flag_gets_the_subcommands_usage_and_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["rollout", "--stepz", "3", "--temprature=2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: agentloop rollout ")  # the subcommand's usage, not the top level's
    assert "agentloop rollout: error: unrecognized arguments: --stepz 3 --temprature=2" in err
    assert "--stepz: did you mean --steps" in err and "--temprature: did you mean --temperature?" in err
    with pytest.raises(SystemExit):
        main(["config", "--show", "--chek", "run.yaml"])
    err = capsys.readouterr().err
    assert "usage: agentloop config" in err and "--chek: did you mean --check" in err


def test_engine_urls_without_a_scheme_are_http_and_bad_ones_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RuntimeConfig.model_validate({"engine": {"urls": ["127.0.0.1:30000", "http://gpu-node:30001/"]}})
    assert cfg.engine.urls == ["http://127.0.0.1:30000", "http://gpu-node:30001"]
    assert main(["rollout", "--engine-url", "grpc://127.0.0.1:30000", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--engine-url: runtime.engine.urls: engine URL 'grpc://127.0.0.1:30000': scheme 'grpc' is not http" in err
    assert "expected http://HOST:PORT" in err and "Traceback" not in err
    assert main(["rollout", "--engine-url", "localhost:port", "-q"]) == 2
    assert "the port is not a number" in capsys.readouterr().err


def test_a_missing_model_folder_is_a_bad_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["rollout", "--model", str(tmp_path / "missing"), "--out", str(out), "-q"]) == 2
    assert f"--model {tmp_path / 'missing'} (runtime.engine.model): no such folder" in capsys.readouterr().err
    assert main(["rollout", "--model", str(tmp_path), "--out", str(out), "-q"]) == 2
    assert "no config.json in it" in capsys.readouterr().err
    assert not out.exists()


def test_serve_on_a_busy_port_says_so_without_a_traceback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "agentloop", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"agentloop serve: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "--port 0 for a free one" in proc.stderr and "Traceback" not in proc.stderr
