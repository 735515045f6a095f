"""A model turn cut by a drained weight update goes on in place (`Episode.generate`): what the aborted
request sampled is kept as a piece of the turn with its own version and logprobs, the rest of the turn
is requested again, and the agent sees the whole turn. Aborts for any other reason still end the
trajectory aborted (a partial rollout to resume), and an engine that keeps aborting cannot loop."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from agentloop.agents.base import AgentConfig, AgentContext
from agentloop.agents.episode import MAX_PIECES_PER_TURN
from agentloop.agents.registry import get_agent
from agentloop.engine.base import GenerateOutput, SamplingParams
from agentloop.types import Sample

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Step = Callable[[list[int], SamplingParams], GenerateOutput]


class Script:
    """Answers each generate with the next step; records what was asked."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.inputs: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def __call__(self, input_ids: list[int], p: SamplingParams) -> GenerateOutput:
        self.inputs.append(list(input_ids))
        self.params.append(p)
        step = self.steps[min(len(self.inputs) - 1, len(self.steps) - 1)]
        return step(list(input_ids), p)


def sampled(ids: list[int], lps: list[float], version: str, *, cut: bool = False, for_update: bool = True) -> Step:
    def step(_: list[int], p: SamplingParams) -> GenerateOutput:
        assert len(ids) <= p.max_new_tokens
        reason: dict[str, Any] = {"type": "abort", "message": "drained"} if cut else {"type": "length", "length": len(ids)}
        out = GenerateOutput(list(ids), list(lps), reason, version, f"r{version}", completion_tokens=len(ids))
        out.interrupted_for_update = cut and for_update
        return out
    return step


def replay(gen: int = 10, max_response: int | None = None) -> tuple[Sample, dict[str, Any]]:
    s = Sample(uid="p0", messages=[], agent="replay", extra={"replay": {"prompt_tokens": 5, "turns": [{"gen_tokens": gen}]}})
    cfg: dict[str, Any] = {} if max_response is None else {"max_response_tokens": max_response}
    return s, cfg


async def run(script: Script, gen: int = 10, max_response: int | None = None):
    s, cfg = replay(gen, max_response)
    return await get_agent("replay").run(s, AgentContext(generate=script, tokenizer=None, config=AgentConfig(**cfg)))


async def test_a_turn_cut_by_an_update_goes_on_in_place_with_each_piece_versioned() -> None:
    script = Script([sampled([11, 12, 13, 14], [-0.1, -0.2, -0.3, -0.4], "v1", cut=True),
                     sampled([15, 16, 17, 18, 19, 20], [-1.5, -1.6, -1.7, -1.8, -1.9, -2.0], "v2")])
    t = await run(script)
    assert t.status == "completed" and t.num_turns == 1, (t.status, t.error)
    t.check_invariants()
    assert t.response_ids == list(range(11, 21)) and t.response_mask == [1] * 10
    assert t.response_logprobs == [-0.1, -0.2, -0.3, -0.4, -1.5, -1.6, -1.7, -1.8, -1.9, -2.0]
    assert [(tr.start, tr.length, tr.weight_version) for tr in t.turns] == [(0, 4, "v1"), (4, 6, "v2")]
    # the rest of the turn: the context with the piece's tokens, only the tokens still wanted
    assert script.inputs[1] == script.inputs[0] + [11, 12, 13, 14]
    assert [p.max_new_tokens for p in script.params] == [10, 6]
    assert t.metrics["interrupted_for_update"] == 1.0


async def test_an_update_before_the_first_token_resends_the_whole_turn() -> None:
    script = Script([sampled([], [], "v1", cut=True), sampled(list(range(30, 40)), [-0.5] * 10, "v2")])
    t = await run(script)
    assert t.status == "completed" and [(tr.length, tr.weight_version) for tr in t.turns] == [(10, "v2")]
    assert script.inputs[0] == script.inputs[1] and [p.max_new_tokens for p in script.params] == [10, 10]


async def test_an_abort_for_another_reason_still_ends_the_trajectory_aborted() -> None:
    script = Script([sampled([11, 12], [-0.1, -0.2], "v1", cut=True, for_update=False),
                     sampled(list(range(8)), [-0.5] * 8, "v1")])
    t = await run(script)
    assert (t.status, len(script.inputs)) == ("aborted", 1)
    assert [(tr.length, tr.weight_version) for tr in t.turns] == [(2, "v1")]  # kept: a resume continues it


async def test_a_session_stopped_after_a_piece_returns_the_piece_aborted() -> None:
    stopped: Step = lambda ids, p: GenerateOutput([], [], {"type": "abort", "message": "not dispatched"}, "", "")  # noqa: E731
    script = Script([sampled([11, 12, 13], [-0.1, -0.2, -0.3], "v1", cut=True), stopped])
    t = await run(script)
    assert t.status == "aborted" and t.response_ids == [11, 12, 13]
    assert [(tr.length, tr.weight_version) for tr in t.turns] == [(3, "v1")]


async def test_an_engine_that_always_aborts_for_updates_cannot_loop_a_turn() -> None:
    script = Script([sampled([], [], "v1", cut=True)])
    t = await run(script)
    assert t.status == "aborted" and t.response_ids == []
    assert len(script.inputs) == MAX_PIECES_PER_TURN


async def test_a_piece_that_spends_the_budget_ends_the_turn_without_another_request() -> None:
    script = Script([sampled([11, 12, 13, 14], [-0.1] * 4, "v1", cut=True), sampled([99], [-9.0], "v2")])
    t = await run(script, gen=10, max_response=4)
    assert len(script.inputs) == 1 and t.response_ids == [11, 12, 13, 14]
    assert (t.status, t.finish_reason) == ("truncated", "max_response_tokens")


async def test_an_abort_landing_after_the_last_wanted_token_ends_the_turn_by_its_length() -> None:
    script = Script([sampled([11, 12, 13, 14], [-0.1] * 4, "v1", cut=True), sampled([99], [-9.0], "v2")])
    t = await run(script, gen=4)
    assert (t.status, len(script.inputs), t.response_ids) == ("completed", 1, [11, 12, 13, 14])
    assert t.turns[0].finish_reason == {"type": "length", "length": 4}


async def test_many_pieces_add_up_to_the_turn_with_exact_tokens() -> None:
    pieces = [[1, 2], [], [3], [4, 5, 6], [7, 8, 9, 10]]
    steps = [sampled(ids, [-float(i) for i in ids], f"v{k}", cut=k < len(pieces) - 1) for k, ids in enumerate(pieces)]
    script = Script(steps)
    t = await run(script)
    assert t.status == "completed" and t.response_ids == list(range(1, 11))
    assert t.response_logprobs == [-float(i) for i in range(1, 11)]
    assert [tr.weight_version for tr in t.turns] == ["v0", "v2", "v3", "v4"]  # the empty piece left no turn
    assert [p.max_new_tokens for p in script.params] == [10, 8, 8, 7, 4]
