"""`seed` (`--seed`, `runtime.agent.sampling.seed`) makes a run repeatable without collapsing GRPO groups: each
model turn of each sample is sent its own `sampling_seed`, derived from the seed, the sample's uid,
its index in the group and the turn (a single seed on every request made the n samples of a prompt
identical). Checked against the real CPU engine, two steps per run."""

from __future__ import annotations

from typing import Any

from agentloop.agents.base import sample_seed
from agentloop.runtime import Runtime
from agentloop.types import Sample


def test_sample_seed_is_stable_distinct_and_in_range() -> None:
    seeds = {sample_seed(1, uid, i, turn) for uid in ("q0", "q1") for i in range(8) for turn in range(3)}
    assert len(seeds) == 2 * 8 * 3  # every sample and turn draws its own stream
    assert all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(1, "q0", 0, 0) == sample_seed(1, "q0", 0, 0) != sample_seed(2, "q0", 0, 0)
    assert sample_seed(7, "q0", 3, 1) == 1827837001  # pinned: a seed means the same run on every platform and version


async def _two_steps(url: str, seed: int | None) -> tuple[list[list[Any]], list[int]]:
    cfg = {"engine": {"urls": [url]}, "scheduler": {"n": 4},
           "agent": {"agent": "single_turn", "sampling": {"temperature": 1.5, "seed": seed}, "max_new_tokens_per_turn": 12}}
    prompts = [Sample(uid=f"q{i}", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(3)]
    sent: list[int] = []
    async with Runtime(cfg) as rt:
        generate = rt.clients[0].generate

        async def recording(input_ids, sampling_params, **kw):  # noqa: ANN001, ANN003, ANN202
            sent.append(sampling_params.sampling_seed)
            return await generate(input_ids, sampling_params, **kw)

        rt.clients[0].generate = recording  # type: ignore[method-assign]
        steps = []
        for _ in range(2):
            res = await rt.step(prompts)
            assert len(res.trajectories) == 12 and all(t.status in ("completed", "truncated") for t in res.trajectories)
            steps.append([(t.uid, t.group_id, tuple(t.response_ids), tuple(t.response_logprobs))
                          for t in res.trajectories])
    return steps, sent


async def test_seeded_groups_stay_diverse_and_the_run_repeats_exactly(local_engine: str) -> None:
    first, sent = await _two_steps(local_engine, seed=1)
    for step in first:
        for group in ("q0", "q1", "q2"):
            responses = [r[2] for r in step if r[1] == group]
            assert len(responses) == 4 and len(set(responses)) == 4, f"group {group} collapsed: {responses}"
    assert None not in sent and len(set(sent)) == len(sent) // 2  # one seed per sample, the same in both steps
    # each run attaches to the server the last one used (and left as it found it)
    again, sent_again = await _two_steps(local_engine, seed=1)
    assert sent_again == sent
    # The same tokens in the same order; logprobs equal up to float noise (the CPU engine batches the
    # concurrent requests differently from run to run, and a batched matmul may round differently).
    assert [[r[:3] for r in step] for step in again] == [[r[:3] for r in step] for step in first]
    diffs = [abs(a - b) for s1, s2 in zip(again, first) for r1, r2 in zip(s1, s2) for a, b in zip(r1[3], r2[3])]
    assert len(diffs) == sum(len(r[3]) for step in first for r in step) and max(diffs) < 1e-4
    other, _ = await _two_steps(local_engine, seed=2)
    assert [r[2] for r in other[0]] != [r[2] for r in first[0]]


def test_unseeded_turns_send_no_sampling_seed_field() -> None:
    from agentloop.agents.base import AgentConfig

    assert "sampling_seed" not in AgentConfig().turn_sampling().to_json()  # not even an explicit null
    assert AgentConfig(sampling={"seed": 7}).turn_sampling().to_json()["sampling_seed"] == 7
