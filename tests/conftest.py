"""Generic fixtures shared by test modules.

- `random_model_dir` (session): a tiny random-weight Qwen2 model folder with a tokenizer.
- `local_engine` (module): `agentloop serve` on that model as a real subprocess on a free loopback
  port; yields its URL. Tests that change engine state (memory, weights, pause) put it back before
  they end.
- `start_local_engine`: a factory for modules that need their own engine (other model, other args).
  Servers come from the session's `EnginePool`s (tests/engine_pool.py, one per model and command line):
  a module gets a server an earlier module of this session (this xdist worker) gave back only if it is
  indistinguishable from a fresh start, else a new one; so modules share servers without seeing what
  another left. At the end of the module its servers go back to the pool; the servers of pools not
  used lately are stopped (`IDLE_POOLS`), the rest at the end of the session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

import pytest

from engine_pool import EnginePool

# Engine subprocesses of the test suite run with one torch thread: the CI machine has 2 cores.
ENGINE_TEST_ARGS: tuple[str, ...] = ("--num-threads", "1", "--log-level", "warning")

#: Seconds the longest test files took in one full run of the README's command (`--durations=0`,
#: summed per file, 2026-12-06). xdist's `--dist loadfile` hands whole files to its workers in
#: collection order, so the longest go first (longest-processing-time-first) and the run does not end
#: waiting on one long file that started last. Files not listed keep their order after these.
#: test_stream_engine.py's figure is its own run alone (`--durations`: 56 s, plus 13 s for the hung-fleet
#: test added after), since its new tests came after the full run.
FILE_SECONDS: dict[str, float] = {
    "test_distributed.py": 221, "test_cli_ray.py": 155, "test_benchmarks_smoke.py": 130, "test_docs_code.py": 105,
    "test_engine_faults.py": 105, "test_cli_rollout.py": 93, "test_launch.py": 60, "test_stream_engine.py": 69,
    "test_engine_owner.py": 50, "test_tool_faults.py": 47, "test_tool_isolation.py": 43, "test_cli_rollout_faults.py": 40,
    "test_python_sandbox.py": 33, "test_soak_smoke.py": 33, "test_local_engine_sglang_parity.py": 32,
    "test_tiny_model.py": 32, "test_local_engine.py": 29, "test_runtime.py": 28, "test_example_grpo_gpu.py": 27,
    "test_engine_tether.py": 27, "test_integrations_verl.py": 23, "test_example_grpo_stream.py": 21,
    "test_python_sandbox_kernel.py": 21, "test_example_grpo.py": 21, "test_serve_weight_bounds.py": 19,
    "test_clone_layout.py": 18, "test_openai_agent.py": 16, "test_runtime_api.py": 16,
    "test_local_engine_priority.py": 39,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a stable sort: each file's tests keep their order, and files of equal weight theirs
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0.0))


def _run(make: Callable[[], Awaitable[Any]]) -> Any:
    """Run a coroutine to completion on a fresh loop in a helper thread: works from sync fixtures
    and from inside async tests (where the test's own loop is already running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentloop.models.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("random_model") / "qwen2-tiny", seed=0)


#: Pools whose idle servers outlive the module that gave them back: the most recently used ones (a
#: few hundred MB of memory per server).
IDLE_POOLS = 2


@pytest.fixture(scope="session")
def engine_pools() -> Iterator[dict[tuple[Path, tuple[str, ...]], EnginePool]]:
    """This session's `EnginePool`s by (model folder, server arguments), the most recently used last."""
    pools: dict[tuple[Path, tuple[str, ...]], EnginePool] = {}
    yield pools
    for pool in pools.values():
        pool.close_sync()


@pytest.fixture(scope="module")
def start_local_engine(engine_pools: dict[tuple[Path, tuple[str, ...]], EnginePool],
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    handed: list[tuple[EnginePool, list[Any]]] = []

    def start(model_dir: Path, extra_args: Sequence[str] = ()) -> str:
        key = (Path(model_dir).resolve(), (*ENGINE_TEST_ARGS, *extra_args))
        pool = engine_pools.pop(key, None) or EnginePool(key[0], key[1], log_dir=tmp_path_factory.mktemp("engine_logs"))
        engine_pools[key] = pool  # most recently used last
        procs = _run(lambda: pool.checkout(1))
        handed.append((pool, procs))
        return procs[0].url

    yield start
    for pool, procs in handed:
        pool.checkin(procs)
    for pool in [p for p in engine_pools.values() if p.idle][:-IDLE_POOLS]:
        _run(pool.stop_idle)


@pytest.fixture(scope="module")
def local_engine(start_local_engine: Callable[..., str], random_model_dir: Path) -> str:
    return start_local_engine(random_model_dir)

