"""agentloop → verl with the real verl package (0.9.1): `to_dataproto` builds a `verl.DataProto` that verl's
own `compute_grpo_outcome_advantage` turns into per-group advantages summing to ~0 within each group,
with failed trajectories excluded (dropped, or masked into groups of their own), padded to a divisor
with verl's `pad_dataproto_to_divisor`; and a real 2-step rollout on the embedded engine converts the same way."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="needs verl (pip install 'agentloop[verl]')")

from verl import DataProto  # noqa: E402
from verl.protocol import unpad_dataproto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402

from agentloop.batch import weight_version_number  # noqa: E402
from agentloop.integrations.verl import to_dataproto  # noqa: E402
from agentloop.runtime.types import StepResult  # noqa: E402
from agentloop.types import Trajectory, TurnRecord  # noqa: E402

pytestmark = pytest.mark.verl


def traj(uid: str, group: str, reward: float | None, *, status: str = "completed", turns=((3, "v1"), (2, "v2")),
         prompt_len: int = 4, k: int = 0) -> Trajectory:
    """A tool-loop shaped trajectory: model turns (mask 1) separated by 2 tool tokens (mask 0)."""
    ids, mask, lps, recs = [], [], [], []
    for j, (n, version) in enumerate(turns):
        if j:
            ids += [900, 901]
            mask += [0, 0]
            lps += [0.0, 0.0]
        recs.append(TurnRecord(start=len(ids), length=n, weight_version=version, finish_reason={"type": "stop"}))
        ids += [10 + j * 10 + i for i in range(n)]
        mask += [1] * n
        lps += [-0.1 * (i + 1) for i in range(n)]
    return Trajectory(uid=uid, group_id=group, prompt_ids=list(range(1, prompt_len + 1)), response_ids=ids,
                      response_mask=mask, response_logprobs=lps, status=status, reward=reward, turns=recs,
                      index_in_group=k, num_turns=len(turns), finish_reason="stop" if status == "completed" else "error",
                      error=None if status in ("completed", "truncated") else "boom")


def step_of(trajs: list[Trajectory]) -> StepResult:
    return StepResult(step=1, weight_version="v2", trajectories=trajs, batch=None)  # type: ignore[arg-type]


def grpo(data: DataProto) -> torch.Tensor:
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=data.batch["token_level_scores"],
                                            response_mask=data.batch["response_mask"], index=data.non_tensor_batch["uid"])
    return adv


def row_advantage(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The scalar advantage of each row (GRPO broadcasts one value over the row's mask-1 tokens)."""
    out = []
    for a, m in zip(adv, mask):
        vals = a[m.bool()]
        assert vals.numel() == 0 or torch.allclose(vals, vals[0])
        out.append(float(vals[0]) if vals.numel() else 0.0)
    return out


def groups_with_failures() -> list[Trajectory]:
    return [
        traj("a_0", "a", 1.0, k=0), traj("a_1", "a", 0.0, k=1), traj("a_2", "a", None, status="failed", k=2),
        traj("a_3", "a", 1.0, k=3, status="truncated", turns=((4, "v2"),)),
        traj("b_0", "b", 0.5, k=0, prompt_len=6), traj("b_1", "b", None, status="aborted", k=1), traj("b_2", "b", 0.0, k=2),
        traj("c_0", "c", 2.0, k=0, turns=((5, "v3"),)), traj("c_1", "c", 3.0, k=1),
    ]


def test_layout_matches_verl_and_uid_is_the_group() -> None:
    trajs = groups_with_failures()
    data = to_dataproto(step_of(trajs))
    assert isinstance(data, DataProto)
    kept = [t for t in trajs if t.status in ("completed", "truncated")]
    assert len(data) == len(kept) and data.meta_info["dropped"] == 2 and data.meta_info["pad_size"] == 0
    assert list(data.non_tensor_batch["uid"]) == [t.group_id for t in kept]  # uid = GRPO group, not trajectory
    assert list(data.non_tensor_batch["trajectory_uid"]) == [t.uid for t in kept]
    b = data.batch
    P = b["prompts"].shape[1]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert torch.equal(b["position_ids"], compute_position_id_with_mask(b["attention_mask"]))
    for i, t in enumerate(kept):
        n_p, n_r = len(t.prompt_ids), len(t.response_ids)
        assert b["prompts"][i, P - n_p:].tolist() == t.prompt_ids and b["attention_mask"][i, :P - n_p].sum() == 0
        assert b["responses"][i, :n_r].tolist() == t.response_ids
        assert b["response_mask"][i, :n_r].tolist() == t.response_mask and b["response_mask"][i, n_r:].sum() == 0
        assert b["rollout_log_probs"][i, :n_r].tolist() == pytest.approx(t.response_logprobs)
        # the score sits at the last real response token, where verl's agent loop puts rm_scores
        last = int(b["attention_mask"][i, P:].sum()) - 1
        assert last == n_r - 1 and float(b["token_level_scores"][i, last]) == t.reward
        assert float(b["token_level_scores"][i].sum()) == t.reward
        versions = b["token_weight_versions"][i, :n_r].tolist()
        for rec in t.turns:
            assert versions[rec.start:rec.start + rec.length] == [int(rec.weight_version[1:])] * rec.length
        assert all(v == -1 for v, m in zip(versions, t.response_mask) if not m)


@pytest.mark.parametrize("policy", ["drop", "mask"])
def test_grpo_advantages_sum_to_zero_per_group_and_exclude_failures(policy: str) -> None:
    trajs = groups_with_failures()
    data = to_dataproto(trajs, failed=policy, size_divisor=4)
    assert len(data) % 4 == 0
    adv = grpo(data)
    rows = row_advantage(adv, data.batch["response_mask"])
    nt = data.non_tensor_batch
    by_group: dict[str, list[float]] = defaultdict(list)
    for i in range(len(data)):
        if nt["trainable"][i]:
            by_group[nt["uid"][i]].append(rows[i])
        else:  # failed, aborted or padding: no gradient at all
            assert data.batch["response_mask"][i].sum() == 0 and torch.all(adv[i] == 0)
    assert sorted(by_group) == ["a", "b", "c"]
    for g, vals in by_group.items():
        assert abs(sum(vals)) < 1e-4, (g, vals)
    # Exclusion is exact: the same advantages as for the groups without their failed members.
    ok = [t for t in trajs if t.status in ("completed", "truncated")]
    for g in "abc":
        r = torch.tensor([t.reward for t in ok if t.group_id == g])
        want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
        assert by_group[g] == pytest.approx(want, abs=1e-5)
    if policy == "mask":
        assert len(unpad_dataproto(data, data.meta_info["pad_size"])) == len(trajs)
        failed_uids = [u for u, s, pad in zip(nt["uid"], nt["status"], nt["is_pad"]) if s in ("failed", "aborted") and not pad]
        assert failed_uids == ["a/a_2:untrainable", "b/b_1:untrainable"]


def test_padding_to_a_divisor_uses_verl_and_neutralises_the_copies() -> None:
    data = to_dataproto(groups_with_failures(), size_divisor=5)  # 7 trainable rows -> 10
    assert len(data) == 10 and data.meta_info["pad_size"] == 3
    nt = data.non_tensor_batch
    assert list(nt["is_pad"]) == [False] * 7 + [True] * 3
    assert list(nt["uid"][-3:]) == ["agentloop-pad-0", "agentloop-pad-1", "agentloop-pad-2"]
    assert data.batch["response_mask"][-3:].sum() == 0 and data.batch["token_level_scores"][-3:].sum() == 0
    # verl's pad rows are copies of the first rows; the originals are untouched
    assert torch.equal(data.batch["input_ids"][7:], data.batch["input_ids"][:3])
    assert data.batch["response_mask"][:3].sum() > 0
    assert len(unpad_dataproto(data, 3)) == 7


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="a_0 .*no reward"):
        to_dataproto([traj("a_0", "a", None)])
    with pytest.raises(ValueError, match="none of the 1 trajectories is trainable"):
        to_dataproto([traj("a_0", "a", None, status="failed")])
    with pytest.raises(ValueError, match="failed must be"):
        to_dataproto([traj("a_0", "a", 1.0)], failed="keep")  # type: ignore[arg-type]


@pytest.mark.slow
def test_real_two_step_rollout_converts_for_verl_grpo() -> None:
    """Two real steps on the embedded CPU engine with the tiny tool model (staged wake-up each step);
    a reward function that fails on some members: verl's GRPO sees only the trainable ones."""
    from agentloop.runtime import Runtime
    from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions
    from agentloop.types import Sample

    def reward(trajectory: Trajectory, sample: Sample) -> float:
        if sample.index_in_group == 1 and sample.group_id.endswith("q0"):
            raise RuntimeError("grader crashed")  # -> this trajectory is failed, the step goes on
        return float(len(trajectory.response_ids) % 7)

    cfg = {"engine": {"local": {"num_threads": 1}}, "scheduler": {"n": 3},
           "agent": {"max_new_tokens_per_turn": 48, "max_response_tokens": 160}}
    with Runtime(cfg, reward_fn=reward) as rt:
        for step in range(2):
            qs = generate_questions(3, seed=100 + step)
            samples = [Sample(uid=f"s{step}q{i}", messages=[{"role": "user", "content": q.question}],
                              tools=[CALCULATOR_TOOL]) for i, q in enumerate(qs)]
            res = rt.step_sync(samples)
            assert res.metrics["stage_seconds"].keys() >= {"wake_up/resume_weights", "wake_up/update_weights", "wake_up/resume_kv_cache"}
            failed = [t for t in res.trajectories if t.status == "failed"]
            assert [t.uid for t in failed] == [f"s{step}q0_1"]
            assert res.batch["trainable"].tolist() == [int(t.status != "failed") for t in res.trajectories]
            data = to_dataproto(res, size_divisor=4, pad_token_id=rt.pad_token_id)
            assert len(data) == 8 and data.meta_info["pad_size"] == 0
            adv = grpo(data)
            rows = row_advantage(adv, data.batch["response_mask"])
            sums: dict[str, float] = defaultdict(float)
            for u, a in zip(data.non_tensor_batch["uid"], rows):
                sums[u] += a
            assert sorted(sums) == [f"s{step}q{i}" for i in range(3)]
            assert all(abs(s) < 1e-4 for s in sums.values()), sums
            # mask-1 tokens and their logprobs are the engine's, verbatim
            for i, t in enumerate(t for t in res.trajectories if t.status != "failed"):
                n = len(t.response_ids)
                assert data.batch["responses"][i, :n].tolist() == t.response_ids
                m = torch.tensor(t.response_mask, dtype=torch.bool)
                got = data.batch["rollout_log_probs"][i, :n][m]
                assert torch.allclose(got, torch.tensor(t.response_logprobs)[m])
                want = weight_version_number(res.weight_version or "")
                assert set(data.batch["token_weight_versions"][i, :n][m].tolist()) <= {want}
            assert math.isfinite(float(adv.sum()))
            assert isinstance(data.non_tensor_batch["uid"], np.ndarray)


class EngineLLMClient:
    """verl's `LLMServerClient.generate` interface (request_id, prompt_ids, sampling_params -> TokenOutput)
    answered by a real engine over SGLang's HTTP protocol (the embedded CPU engine here)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.requests: list[str] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        from agentloop.engine.base import SamplingParams
        from agentloop.engine.sglang import SGLangClient

        params = dict(sampling_params)
        assert params.pop("logprobs") is True
        self.requests.append(request_id)
        client = SGLangClient(self.url)  # one per call: each verl call may run on its own event loop
        try:
            out = await client.generate(prompt_ids, SamplingParams.from_mapping(params), rid=f"{request_id}-{len(self.requests)}")
        finally:
            await client.close()
        return TokenOutput(token_ids=out.output_ids, log_probs=out.output_logprobs,
                           stop_reason="aborted" if out.finish_type == "abort" else "completed")


@pytest.fixture(scope="module")
def tiny_engine(start_local_engine) -> str:
    """One embedded engine serving the tiny tool model for the drop-in tests (verl owns its servers' lifecycle)."""
    from agentloop.models import tiny_tool_model

    return start_local_engine(tiny_tool_model())


@pytest.mark.slow
def test_agent_loop_manager_drop_in_two_steps(tiny_engine: str) -> None:
    """verl's trainer calls: `AgentLoopManager.create(config=, llm_client=, ...)`, then per step
    `generate_sequences(gen_batch)` on rows repeated n times (interleaved) with a shared `uid`; the output
    unions with the batch and verl's GRPO advantage runs on it."""
    from omegaconf import OmegaConf

    from agentloop.integrations.verl import AgentLoopManager
    from agentloop.models import tiny_tool_model
    from agentloop.tasks.arithmetic import generate_questions

    model = tiny_tool_model()
    client = EngineLLMClient(tiny_engine)
    cfg = OmegaConf.create({"actor_rollout_ref": {
        "model": {"path": str(model)},
        "rollout": {"prompt_length": 256, "response_length": 192, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 3,
                    "multi_turn": {"max_assistant_turns": 4, "tool_config_path": None},
                    "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
                    "agent": {"agentloop": {"scheduler": {"reward": "arithmetic"},
                                            "agent": {"max_new_tokens_per_turn": 48}}}}}})
    manager = AgentLoopManager.create(config=cfg, llm_client=client)
    for step in range(2):
        qs = generate_questions(2, seed=300 + step)
        # As verl's RLHFDataset + RayPPOTrainer build them: a dummy tensor, the chat, reward keys, uid per prompt.
        non_tensors = {
            "raw_prompt": _objs([[{"role": "user", "content": q.question}] for q in qs]),
            "reward_model": _objs([{"ground_truth": q.answer, "style": "rule"} for q in qs]),
            "uid": _objs([f"s{step}-p{i}" for i in range(2)]),
        }
        batch = DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(2, 1, dtype=torch.uint8)}, non_tensors=non_tensors)
        gen = DataProto.from_dict(non_tensors={k: v.copy() for k, v in non_tensors.items()}).repeat(3, interleave=True)
        out = manager.generate_sequences(gen)
        assert len(out) == 6 and out.batch["prompts"].shape[1] == 256 and out.batch["responses"].shape[1] == 192
        assert "timing" in out.meta_info and len(out.meta_info["metrics"]) == 6
        merged = batch.repeat(3, interleave=True).union(out)  # as verl's trainer does: rows must stay aligned
        assert torch.equal(merged.batch["position_ids"], compute_position_id_with_mask(merged.batch["attention_mask"]))
        statuses = list(out.non_tensor_batch["agentloop_status"])
        assert statuses.count("completed") + statuses.count("truncated") >= 5
        assert out.non_tensor_batch["agentloop_tool_calls"].sum() > 0  # the tiny model called the calculator
        rm = out.batch["rm_scores"]
        last = out.batch["attention_mask"][:, 256:].sum(-1) - 1
        assert torch.equal(rm.sum(-1), rm[torch.arange(6), last])
        adv, _ = compute_grpo_outcome_advantage(token_level_rewards=rm, response_mask=merged.batch["response_mask"],
                                                index=merged.non_tensor_batch["uid"])
        rows = row_advantage(adv, merged.batch["response_mask"])
        for g in (f"s{step}-p0", f"s{step}-p1"):
            assert abs(sum(a for a, u in zip(rows, merged.non_tensor_batch["uid"]) if u == g)) < 1e-4
    assert len(client.requests) >= 12 and all("#" in r for r in client.requests)  # sticky key = trajectory


def _objs(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


class RewardWorkerHandle:
    """A reward-loop worker handle as verl's trainer passes it (`handle.compute_score.remote(data)`, awaited),
    served by verl's own `NaiveRewardManager.run_single` (built per call: it binds the running event loop)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seen: list[DataProto] = []
        self.compute_score = self  # handle.compute_score.remote(...)

    @staticmethod
    def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
        return float(solution_str.rstrip().endswith(f"The answer is {ground_truth}."))

    def remote(self, data: DataProto):
        from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

        self.seen.append(data)
        return NaiveRewardManager(config=None, tokenizer=self.tokenizer, compute_score=self.score).run_single(data)


@pytest.mark.slow
def test_agent_loop_manager_scores_with_verls_reward_loop_workers(tiny_engine: str) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from agentloop.integrations.verl import AgentLoopManager
    from agentloop.models import tiny_tool_model
    from agentloop.tasks.arithmetic import generate_questions

    model = tiny_tool_model()
    worker = RewardWorkerHandle(AutoTokenizer.from_pretrained(str(model)))
    cfg = OmegaConf.create({"actor_rollout_ref": {
        "model": {"path": str(model)},
        "rollout": {"prompt_length": 256, "response_length": 192, "temperature": 1.0,
                    "agent": {"agentloop": {"agent": {"max_new_tokens_per_turn": 48}}}}}})
    manager = AgentLoopManager.create(config=cfg, llm_client=EngineLLMClient(tiny_engine),
                                      reward_loop_worker_handles=[worker])
    qs = generate_questions(2, seed=7)
    gen = DataProto.from_dict(non_tensors={
        "raw_prompt": _objs([[{"role": "user", "content": q.question}] for q in qs]),
        "reward_model": _objs([{"ground_truth": q.answer, "style": "rule"} for q in qs]),
        "data_source": _objs(["arithmetic"] * 2), "uid": _objs(["p0", "p1"]),
    }).repeat(2, interleave=True)
    out = manager.generate_sequences(gen)
    statuses = list(out.non_tensor_batch["agentloop_status"])
    finished = [i for i, s in enumerate(statuses) if s in ("completed", "truncated")]
    assert len(worker.seen) == len(finished) >= 3  # one reward-loop call per finished trajectory
    for data in worker.seen:  # what verl's reward loop reads: unpadded tensors and the row's non-tensor fields
        assert len(data) == 1 and {"prompts", "responses", "attention_mask"} <= set(data.batch.keys())
        assert data.non_tensor_batch["reward_model"][0]["ground_truth"] in [q.answer for q in qs]
    scores = out.batch["rm_scores"].sum(-1)
    for i in finished:  # rm_scores holds what verl's reward manager computed on this row's response text
        n = int(out.batch["attention_mask"][i, 256:].sum())
        text = worker.tokenizer.decode(out.batch["responses"][i, :n].tolist(), skip_special_tokens=True)
        assert float(scores[i]) == RewardWorkerHandle.score("arithmetic", text, qs[i // 2].answer)


def test_agent_loop_manager_refuses_a_distillation_teacher_saying_what_to_do() -> None:
    from omegaconf import OmegaConf

    from agentloop.integrations.verl import AgentLoopManager

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": 8}}})
    with pytest.raises(ValueError, match=r"teacher_client.*does not support verl's on-policy distillation.*turn distillation off"):
        AgentLoopManager(cfg, llm_client=object(), teacher_client=object())


def test_drop_in_scores_a_failed_row_with_its_group_mean() -> None:
    """The drop-in must keep verl's rows and uids: a failed row is masked and scored at its group's mean,
    so verl's GRPO gives it advantage 0 and leaves the group's mean baseline as it was."""
    from agentloop.integrations.verl_rollout import group_mean_filled_scores

    ts = groups_with_failures()
    scores = group_mean_filled_scores(ts)
    assert scores[2] == pytest.approx(2 / 3) and scores[5] == pytest.approx(0.25)
    rewards = torch.zeros(len(ts), 3)
    rewards[:, -1] = torch.tensor(scores)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=torch.ones(len(ts), 3),
                                            index=np.array([t.group_id for t in ts], dtype=object))
    assert abs(float(adv[2, 0])) < 1e-6 and abs(float(adv[5, 0])) < 1e-6
    a = [0, 1, 3]
    assert sum(float(adv[i, 0]) for i in a) == pytest.approx(0.0, abs=1e-5)


def test_verl_rows_become_group_members() -> None:
    from agentloop.integrations.verl_rollout import rows_to_samples

    gen = DataProto.from_dict(non_tensors={
        "raw_prompt": _objs([[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]]),
        "reward_model": _objs([{"ground_truth": 2}, {"ground_truth": 4}]),
        "agent_name": _objs(["tool_agent", "single_turn_agent"]),
        "uid": _objs(["u0", "u1"]),
    }).repeat(2, interleave=True)  # as verl's trainer repeats for rollout.n
    samples = rows_to_samples(gen)
    assert [(s.uid, s.group_id, s.index_in_group) for s in samples] == [
        ("u0#0", "u0", 0), ("u0#1", "u0", 1), ("u1#0", "u1", 0), ("u1#1", "u1", 1)]
    assert [s.agent for s in samples] == ["tool", "tool", "single_turn", "single_turn"]
    assert [s.ground_truth for s in samples] == [2, 2, 4, 4]
    assert samples[0].messages == [{"role": "user", "content": "1+1?"}]
    with pytest.raises(ValueError, match="return_raw_chat"):
        rows_to_samples(DataProto.from_dict(non_tensors={"uid": _objs(["u0"])}))
