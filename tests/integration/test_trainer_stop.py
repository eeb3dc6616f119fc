"""A stop that lands while a trainer's step is in the learner (the real tiny model, hivemind,
in this process): the step ends before the trainer does, with its metrics row, its groups
trained and its version checkpointed. Before, the learn loop's cancellation left the step
to the event loop's end, which cancelled it after the optimizer had stepped: the weights
moved, and neither the row nor the groups' "trained" was ever recorded."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from agentjet.config import load_config
from agentjet.metrics import read_metrics
from node.trainer_host import TrainerHost
from tests.factories import make_group, tiny_trainer_settings

pytestmark = pytest.mark.integration

# Bound on the wait for the learn loop's cancellation (it follows the stop at once).
WAIT_S = 60.0


def test_a_stop_during_a_step_lets_the_step_end_and_be_recorded(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path
) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="aj-", dir="/tmp"))
    endpoint = f"ipc://{socket_dir}/trainer.ipc"
    config = load_config(
        None,
        [
            *tiny_trainer_settings(tiny_model_dir, endpoint, keys_file, tmp_path / "run"),
            "trainer.groups_per_step=2",
            "rollout.group_size=2",  # the swarm batch: the two factory groups (2 samples each)
            "trainer.max_logprob_gap=0",  # the factory's logprobs are not the tiny model's
        ],
    )
    host = TrainerHost(config, [""])
    groups = [make_group(f"g{i}") for i in range(2)]
    cancelled = threading.Event()  # the learn loop was cancelled: the stop went through

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        [trainer] = host.trainers
        train_step = trainer.learner.train_step

        def stop_now() -> None:
            [learn] = [t for t in asyncio.all_tasks() if t.get_name() == "trainer-learn"]
            learn.add_done_callback(lambda _: cancelled.set())
            stop.set()

        def stopped_mid_step(*args: Any, **kwargs: Any) -> Any:
            loop.call_soon_threadsafe(stop_now)
            assert cancelled.wait(WAIT_S), "the stop did not cancel the learn loop"
            return train_step(*args, **kwargs)

        trainer.learner.train_step = stopped_mid_step  # type: ignore[method-assign]
        for group in groups:
            trainer.book.accept(group)
        trainer.batch_ready.set()
        await host.run(stop)

    with ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, socket_dir, ignore_errors=True)  # last: after setup's
        host.setup(cleanup)
        asyncio.run(main())
    assert cancelled.is_set()
    [trainer] = host.trainers  # its cleanup wrote the final checkpoint: trained is durable
    assert {g.group_id: trainer.book.status(g.group_id) for g in groups} == {
        "g0": "trained",
        "g1": "trained",
    }
    rows = read_metrics(tmp_path / "run" / "metrics" / "trainer.jsonl")
    [step] = [r for r in rows if r.get("event") == "step"]
    assert sorted(step["trained_group_ids"]) == ["g0", "g1"]
    assert step["policy_version"] == 1 and step["optimizer_stepped"]
    [stopped] = [r for r in rows if r.get("event") == "stopped"]
    assert stopped["policy_version"] == 1
    assert (tmp_path / "run" / "checkpoints" / "v000001").is_dir()
