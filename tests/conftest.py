"""Generic fixtures shared by test modules.

- `random_model_dir` (session): a tiny random-weight Qwen2 model folder with a tokenizer.
- `local_engine` (module): `agentloop serve` on that model as a real subprocess on a free loopback
  port; yields its URL. Module scope keeps the suite fast (one start per module); tests that change
  engine state (memory, weights, pause) put it back before they end.
- `start_local_engine`: a factory for modules that need their own engine (other model, other args);
  every engine it starts is stopped at the end of the module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

import pytest

# Engine subprocesses of the test suite run with one torch thread: the CI machine has 2 cores.
ENGINE_TEST_ARGS: tuple[str, ...] = ("--num-threads", "1", "--log-level", "warning")


def _run(make: Callable[[], Awaitable[Any]]) -> Any:
    """Run a coroutine to completion on a fresh loop in a helper thread: works from sync fixtures
    and from inside async tests (where the test's own loop is already running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentloop.models.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("random_model") / "qwen2-tiny", seed=0)


@pytest.fixture(scope="module")
def start_local_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    from agentloop.engine.local.process import LocalEngineProcess

    procs: list[LocalEngineProcess] = []

    def start(model_dir: Path, extra_args: Sequence[str] = ()) -> str:
        log_path = tmp_path_factory.mktemp("engine_logs") / "serve.log"
        proc = LocalEngineProcess(model_dir, extra_args=[*ENGINE_TEST_ARGS, *extra_args], log_path=log_path)
        procs.append(proc)
        return _run(lambda: proc.start(timeout=120))

    yield start
    for proc in procs:
        _run(proc.stop)


@pytest.fixture(scope="module")
def local_engine(start_local_engine: Callable[..., str], random_model_dir: Path) -> str:
    return start_local_engine(random_model_dir)

