"""Over-admission on the real CPU engine, 3 steps of `Runtime.step` (staged wake-up with new weights →
rollout → sleep): each step keeps `active` trajectories in flight from the trainer's feeder, returns
as soon as `target_groups` groups are complete, and carries the rest as partial rollouts that resume
next step exactly (the tokens and logprobs sampled before the stop kept verbatim, tagged with the
version that sampled them; later turns with the new weights); `max_staleness` holds for every
returned token and the staleness histogram accounts for every sampled token."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from safetensors.torch import load_file

from agentloop.engine.lifecycle import Weights
from agentloop.models.random_model import make_random_model
from agentloop.runtime import Runtime
from agentloop.types import Sample
from engine_pool import EnginePool

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("oa") / "model", seed=3)


def prompts() -> Iterator[Sample]:
    """Fresh prompts forever: every other one long (a 240-token first turn), the rest short."""
    k = 0
    while True:
        gens = [240, 4] if k % 2 == 0 else [4, 4]
        turns = [{"gen_tokens": g, "tool_latency_s": 0.01, "tool_result_tokens": 3} for g in gens]
        yield Sample(uid=f"q{k}", messages=[{"role": "user", "content": "x"}], agent="replay",
                     extra={"replay": {"prompt_tokens": 8, "turns": turns}})
        k += 1


async def test_over_admission_carries_partials_that_resume_exactly_within_the_staleness_bound(model_dir: Path) -> None:
    pool = EnginePool(model_dir)
    try:
        async with pool.servers(1) as (proc,):
            cfg = {"engine": {"urls": [proc.url], "tokenizer": str(model_dir)},
                   "scheduler": {"n": 2, "target_groups": 2, "active": 12, "concurrency": 64, "max_staleness": 1},
                   "agent": {"max_new_tokens_per_turn": 400, "max_response_tokens": 600}}
            state_dict = load_file(str(model_dir / "model.safetensors"))
            feeder = prompts()
            carry: list[Sample] = []
            partial_of: dict[str, Any] = {}
            resumed_seen = restarted = 0
            async with Runtime(cfg) as rt:
                for step in range(1, 4):
                    version = f"v{step}"
                    # Carried trajectories whose first token is more than one version old restart.
                    stale = sum(1 for c in carry if c.resume_from is not None and c.resume_from.turns
                                and step - int(c.resume_from.turns[0].weight_version[1:]) > 1)
                    res = await rt.step(carry, Weights(state_dict=state_dict, version=version), more_samples=feeder)
                    m = res.metrics
                    assert res.weight_version == version
                    assert m["complete_groups"] == 2 and len(res.trajectories) == 4
                    assert {t.status for t in res.trajectories} == {"completed"}
                    # Over-admission: more prompts were in play than the batch needs, and the rest carried.
                    assert m["started"] >= 12 and len(res.carry_over) > 0
                    # Every returned sampled token is counted once, and none is older than the bound.
                    sampled = sum(sum(t.response_mask) for t in res.trajectories)
                    assert sum(m["token_staleness"].values()) == sampled
                    assert m["max_token_staleness"] <= 1
                    for t in res.trajectories:
                        t.check_invariants()  # each mask-1 span is a recorded engine turn
                        p = partial_of.get(t.uid)
                        if p is not None and p.status != "aborted":  # finished last step, its group only now
                            assert t.response_ids == p.response_ids and t.weight_versions == p.weight_versions
                            continue
                        if p is None or t.metrics.get("resumed", 0) == 0:  # fresh (or restarted: stale)
                            assert set(t.weight_versions) == {version}
                            continue
                        resumed_seen += 1
                        n = len(p.response_ids)
                        assert t.response_ids[:n] == p.response_ids and t.response_mask[:n] == p.response_mask
                        assert t.response_logprobs[:n] == p.response_logprobs  # from the version that sampled them
                        assert t.weight_versions[: len(p.turns)] == p.weight_versions
                        assert len(t.turns) > len(p.turns) and all(v == version for v in t.weight_versions[len(p.turns):])
                    for s in res.carry_over:
                        if s.resume_from is not None:
                            partial_of[s.uid] = s.resume_from
                    assert m["stale_restarted"] == stale
                    restarted += stale
                    carry = res.carry_over
            assert resumed_seen > 0, "no carried partial came back within 3 steps"
            assert restarted > 0, "no carried partial reached the staleness bound within 3 steps"
    finally:
        await pool.close()
