"""What each Ray rollout worker is configured with: the per-server request limit is split over the workers
(each worker's router holds its own slots), so together they never send a server more than the limit."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("ray")

from agentloop.config import RuntimeConfig  # noqa: E402
from agentloop.distributed.runtime import worker_config  # noqa: E402


@pytest.mark.parametrize("limit,workers,share", [(256, 4, 64), (256, 3, 85), (2, 4, 1), (256, 1, 256), (None, 4, None)])
def test_each_worker_gets_its_share_of_the_per_server_limit(limit: int | None, workers: int, share: int | None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    cfg = RuntimeConfig.model_validate({"scheduler": {"per_server_concurrency": limit, "concurrency": 512}})
    with caplog.at_level(logging.INFO, logger="agentloop.distributed.runtime"):
        out = worker_config(cfg, workers)
    assert out.scheduler.per_server_concurrency == share
    assert out.scheduler.concurrency == 512 and cfg.scheduler.per_server_concurrency == limit  # nothing else changes
    if share is not None and workers > 1:
        assert share * workers <= limit or share == 1
    # an uneven split is said, with what the workers send in all
    assert ("per worker" in caplog.text) == (limit == 256 and workers == 3 or limit == 2)
