"""The memory mark (`agentloop.engine.memory_mark`, docs/memory_mark.md): its versioned format, and the
clean version shown everywhere a user or trainer sees a weight version while a runtime holds a marked
server (step results, trajectories, per-token versions, summaries, the `/model_info` reader, the OpenAI
endpoint's chat completions and `/v1/models`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from agentloop.engine.lease import new_lease
from agentloop.engine.memory_mark import MARK_FORMAT, MARK_SEPARATOR, MarkFormatError, MemoryMark, served_version
from agentloop.output.summary import summarize_step
from agentloop.output.writer import trajectory_record
from agentloop.runtime import Runtime
from agentloop.types import Sample


def test_format_round_trips_and_says_its_version() -> None:
    lease = new_lease(60.0)
    mark = MemoryMark("v3", frozenset({"kv_cache", "weights"}), "resume:weights", True, lease)
    text = mark.encode()
    assert text.startswith(f"v3{MARK_SEPARATOR}fmt={MARK_FORMAT};released=kv_cache,weights;pending=resume:weights;parked=1;owner=")
    assert MemoryMark.decode(text) == mark and served_version(text) == "v3"
    assert MemoryMark("v3").encode() == "v3" and MemoryMark.decode("v3") == MemoryMark("v3")  # plain: nothing held


def test_marks_written_before_the_format_field_read_as_format_1() -> None:
    assert MemoryMark.decode(f"default{MARK_SEPARATOR}released=weights;parked=1") == MemoryMark(
        "default", frozenset({"weights"}), parked=True)


def test_a_newer_format_is_refused_not_guessed() -> None:
    with pytest.raises(MarkFormatError, match=r"format '2'.*up to 1"):
        MemoryMark.decode(f"v1{MARK_SEPARATOR}fmt=2;released=")
    assert served_version(f"v1{MARK_SEPARATOR}fmt=2;released=") == "v1"  # stripping needs no format


#: what the agent below saw (it runs in the runtime's event loop; the test reads it after each step)
SEEN: dict[str, list[str]] = {"fingerprints": [], "models": [], "raw": [], "reader": []}
RUNTIME: dict[str, Runtime] = {}


async def version_agent(client: openai.AsyncOpenAI, sample: Sample) -> float:
    """One chat completion through the OpenAI endpoint, plus what a trainer could read meanwhile."""
    r = await client.chat.completions.create(model="policy", messages=sample.messages, max_tokens=8)
    SEEN["fingerprints"].append(r.system_fingerprint or "")
    SEEN["models"] += [json.dumps(m.model_dump()) for m in (await client.models.list()).data]
    engine = RUNTIME["rt"].clients[0]
    SEEN["raw"].append(str((await engine.model_info())["weight_version"]))  # the server's whole string
    SEEN["reader"].append(await engine.weight_version())  # the reader integrations use
    return 1.0


CONFIG = {
    "engine": {"local": {"num_threads": 1}},
    "scheduler": {"n": 2, "concurrency": 4},
    "agent": {"agent": "openai", "function": "test_memory_mark:version_agent", "max_new_tokens_per_turn": 8,
              "max_response_tokens": 64},
}


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    with Runtime(CONFIG) as runtime:
        RUNTIME["rt"] = runtime
        yield runtime
    RUNTIME.clear()


@pytest.mark.slow
def test_every_version_a_user_sees_is_clean_while_the_server_is_marked(rt: Runtime, tmp_path: Path) -> None:
    assert rt.lifecycle is not None
    for step in (1, 2):
        for v in SEEN.values():
            v.clear()
        samples = [Sample(uid=f"s{step}q{i}", messages=[{"role": "user", "content": f"2+{i}="}]) for i in range(2)]
        res = rt.step_sync(samples)
        served = rt.lifecycle.weight_version
        assert served and MARK_SEPARATOR not in served
        # the test means something: while the runtime held the server, its weight version was marked
        assert SEEN["raw"] and all(MARK_SEPARATOR in v and served_version(v) == served for v in SEEN["raw"])
        assert len(res.trajectories) == 4 and all(t.error is None and t.turns for t in res.trajectories), [
            t.error for t in res.trajectories]  # (8-token answers: completed or truncated)
        shown: list[Any] = [res.weight_version, res.metrics["weight_version"], *SEEN["fingerprints"], *SEEN["reader"]]
        for t in res.trajectories:
            shown += [t.weight_version, *t.weight_versions, *(turn.weight_version for turn in t.turns)]
            row = trajectory_record(t, step=res.step)
            shown += [row["weight_version"], *row["weight_versions"]]
        shown += [v for row in res.batch["turn_weight_versions"] for v in row] + list(res.batch["weight_versions"])
        shown.append(summarize_step(res.trajectories, step=res.step, weight_version=res.weight_version)["weight_version"])
        assert shown and all(v == served for v in shown), shown
        assert SEEN["models"] and all(MARK_SEPARATOR not in m for m in SEEN["models"])
        assert all(int(v) >= 0 for row in res.batch["token_weight_versions"].tolist() for v in row if v != -1)
