"""Verified trajectories against a real trainer process (tiny model, hivemind), over ZMQ.

The honest groups are sampled here by the real TorchEngine from the trainer's own weights
(version 0 of the same tiny model). Forgeries of them: made-up logprobs, altered tokens
(logprobs kept), a wrong reward. The forged ones are never trained and are counted; the
node that keeps sending them is quarantined, its next group refused, and `agentjet status`
lists it under the trainer. The tiny model never answers arithmetic right, so honest
arithmetic groups are all reward 0 (nothing to train, only the reward check to pass); the
honest group that carries gradient, and so meets the logprob check, is played on
python_tool tasks, whose rewards a trainer does not re-check (rewards 1, 0 as set here).
A reward check whose function never returns is given up while the trainer serves on.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from agentjet import protocol
from agentjet.episode import SamplingParams
from agentjet.metrics import read_metrics
from agentjet.tasks import generate_tasks
from node.rollout_produce import build_group
from node.torch_engine import TorchEngine
from sandboxes.envs.arithmetic import ArithmeticEnv
from sandboxes.envs.chat import chat_prompt_ids
from tests.factories import forge, make_group
from tests.integration.test_swarm import swarm_status
from tests.integration.test_trainer_node import Launched, connect, launched_trainer

pytestmark = pytest.mark.integration

GROUP_SIZE = 4
FINAL_STATUS_TIMEOUT_S = 60.0
RECORD_TIMEOUT_S = 30.0
RUN_ID = "verify-test"
# The reward check that never ends is given up after this long; the trainer meanwhile serves
# requests that take milliseconds.
HUNG_CHECK_TIMEOUT_S = 5.0


def honest_groups(
    tiny_model_dir: Path, env: str, count: int, rewards: list[float] | None
) -> list[protocol.TrajectoryGroup]:
    """`count` arithmetic groups sampled by the engine at version 0, named `env`; rewards
    as scored, or `rewards` (per sample) instead."""
    engine = TorchEngine(tiny_model_dir, seed=3)
    tasks = generate_tasks(count, seed=7, difficulties=[1], env="arithmetic")
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    groups = []
    played = asyncio.run(ArithmeticEnv().run_group(engine, tasks, GROUP_SIZE, params))
    for task, episodes in zip(tasks, played, strict=True):
        for episode, reward in zip(episodes, rewards or [], strict=False):
            episode.reward = reward
        grant = protocol.WorkGrant(
            grant_id=f"{env}-{task.id}",
            task=msgspec.structs.replace(task, env=env),
            group_size=GROUP_SIZE,
            lease_s=60.0,
        )
        groups.append(build_group(grant, episodes, "honest", 0.0))
    return groups


async def final_status(client, group_id: str) -> str:
    """Poll GroupStatus until the group is trained or dropped."""
    deadline = time.monotonic() + FINAL_STATUS_TIMEOUT_S
    while time.monotonic() < deadline:
        reply = await client.request(protocol.GroupStatusQuery(group_ids=[group_id]))
        status = reply.statuses[group_id]
        if status in ("trained", "dropped"):
            return status
        await asyncio.sleep(0.2)
    raise AssertionError(f"group {group_id} neither trained nor dropped in time")


def test_forged_groups_are_rejected_and_their_node_quarantined(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path
):
    mixed = honest_groups(tiny_model_dir, "python_tool", 4, rewards=[1.0, 0.0, 1.0, 0.0])
    scored = honest_groups(tiny_model_dir, "arithmetic", 2, rewards=None)
    assert all(s.reward == 0.0 for g in scored for s in g.samples)  # see the module docstring
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    overrides = [
        f'swarm.run_id="{RUN_ID}"',
        f"rollout.group_size={GROUP_SIZE}",
        "rollout.sampling.temperature=1.0",
        "trainer.groups_per_step=1",
        "trainer.max_queued_groups=16",
        "trainer.reward_check_fraction=1.0",
        "trainer.quarantine_after=3",
        # a group is reported "trained" once a checkpoint holds its step
        "trainer.checkpoint_every=1",
    ]
    with launched_trainer(tiny_model_dir, tmp_path, keys_file, overrides) as trainer:
        outcomes = asyncio.run(scenario(trainer, mixed, scored, vocab))
        log = (tmp_path / "trainer.log").read_text()
        join = re.findall(r"--join (\S+)", log)[0]
        deadline = time.monotonic() + RECORD_TIMEOUT_S
        while "quarantined by" not in (shown := swarm_status(join, RUN_ID, keys_file)):
            assert time.monotonic() < deadline, shown
        trainer.stop()
    assert outcomes == {
        "honest python_tool": "trained",
        "honest arithmetic": "trained",
        "zero logprobs": "dropped",
        "altered tokens": "dropped",
        "halved logprobs": "dropped",
        "wrong reward": "rejected",
    }
    trainer_id = re.findall(r"trainer (trainer-\S+) ready", log)[0]
    assert f"quarantined by {trainer_id}: forger" in shown
    metrics = read_metrics(tmp_path / "run" / "metrics" / "trainer.jsonl")
    stopped = [r for r in metrics if r.get("event") == "stopped"][0]
    assert stopped["counts/groups_rejected_logprobs"] == 3
    assert stopped["counts/groups_rejected_reward"] == 1
    assert stopped["counts/groups_refused_quarantined"] == 1
    assert stopped["counts/nodes_quarantined"] == 1
    assert stopped["quarantined"] == ["forger"]
    trained = {g for r in metrics if r.get("event") == "step" for g in r["trained_group_ids"]}
    assert trained == {mixed[0].group_id, scored[0].group_id}
    quarantined = [r for r in metrics if r.get("event") == "quarantined"]
    assert [r["node_id"] for r in quarantined] == ["forger"]


async def scenario(
    trainer: Launched,
    mixed: list[protocol.TrajectoryGroup],
    scored: list[protocol.TrajectoryGroup],
    vocab: int,
) -> dict[str, str]:
    """Submit each group, one at a time; what became of it."""
    # Each group comes from the node it names: the trainer serves a node only under its own
    # certificate's name (agentjet/transport.py).
    clients = {name: await connect(trainer, name=name) for name in ("honest", "forger", "liar")}
    client = clients["honest"]
    submissions = {
        "honest python_tool": mixed[0],
        "honest arithmetic": scored[0],
        "zero logprobs": forge(mixed[1], "zero", logprobs=lambda lp: lp * 0),
        "altered tokens": forge(mixed[2], "altered", tokens=lambda ids: (ids + 1000) % vocab),
        "halved logprobs": forge(mixed[3], "halved", logprobs=lambda lp: lp / 2),
        "wrong reward": forge(
            msgspec.structs.replace(
                scored[1],
                samples=[msgspec.structs.replace(scored[1].samples[0], reward=1.0)]
                + scored[1].samples[1:],
            ),
            "liar",
            node_id="liar",
        ),
    }
    outcomes = {}
    for name, group in submissions.items():
        ack = await clients[group.node_id].request(protocol.SubmitGroup(group=group))
        assert isinstance(ack, protocol.GroupAck), ack
        if ack.status == "accepted":
            outcomes[name] = await final_status(client, group.group_id)
        else:
            outcomes[name] = ack.status
            assert ack.reason.startswith("wrong reward: sample 0: reward 1 reported"), ack
    # three failed checks: the forger's next group is refused
    after = protocol.SubmitGroup(group=forge(mixed[0], "after-quarantine"))
    refused = await clients["forger"].request(after)
    assert refused.status == "rejected" and refused.reason.startswith("quarantined: 3 failed")
    for each in clients.values():
        each.close()
    return outcomes


def test_a_reward_check_that_never_ends_is_given_up_while_the_trainer_serves_on(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path
):
    """A "prompt" environment whose sync reward function never returns (tests/rewards.py
    `blocks`, never released in the trainer's process): while the trainer re-checks a group
    with it, it answers other requests and accepts other groups; after
    trainer.reward_check_timeout_s it gives the check up and accepts the group with the
    rewards it was sent with, counted; and it stops cleanly, that function still blocked."""
    task = protocol.Task(id="q1", env="prompt", prompt="Capital of France?", answer="Paris")
    task_file = tmp_path / "tasks.jsonl"
    row = {"id": task.id, "prompt": task.prompt, "answer": task.answer}
    task_file.write_text(json.dumps(row) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = protocol.pack_ids(chat_prompt_ids(tokenizer, None, task))
    samples = []
    for answer, reward in (("Paris", 1.0), ("Lyon", 0.0)):
        ids = tokenizer.encode(answer, add_special_tokens=False)
        samples.append(
            protocol.Sample(
                prompt_ids=prompt,
                completion_ids=protocol.pack_ids(ids),
                logprobs=protocol.pack_floats([-0.1] * len(ids)),
                loss_mask=protocol.pack_mask([1] * len(ids)),
                reward=reward,
                advantage=0.0,
                policy_version=0,
            )
        )
    hanging = msgspec.structs.replace(
        make_group("hanging"), env="prompt", task_id=task.id, samples=samples
    )
    overrides = [
        f'swarm.run_id="{RUN_ID}"',
        "rollout.group_size=2",
        'envs.0.name="prompt"',
        f"envs.0.task_file={json.dumps(str(task_file))}",
        'envs.0.reward="tests.rewards:blocks"',
        "trainer.reward_check_fraction=1.0",
        f"trainer.reward_check_timeout_s={HUNG_CHECK_TIMEOUT_S}",
        "trainer.groups_per_step=4",  # nothing trains: accepted groups stay queued
    ]
    with launched_trainer(tiny_model_dir, tmp_path, keys_file, overrides) as trainer:
        asyncio.run(serve_beside_a_hung_check(trainer, hanging))
        stopped = trainer.stop()  # (asserts a clean exit, the function's thread blocked)
    assert stopped["counts/reward_check_timeouts"] == 1
    assert stopped["counts/reward_threads_left"] == 1
    assert stopped["counts/groups_accepted"] == 2 and stopped["counts/busy_replies"] == 1
    assert "counts/groups_rejected_reward" not in stopped
    log = (tmp_path / "trainer.log").read_text()
    assert "gave up a reward re-check" in log and "group hanging from test-node" in log


async def serve_beside_a_hung_check(trainer: Launched, hanging: protocol.TrajectoryGroup) -> None:
    # The group is sent twice at once, by two clients: one copy starts the check, and the
    # other is answered "busy" (a group in its check is sent again) while the check runs.
    clients = [await connect(trainer) for _ in range(3)]
    submit = protocol.SubmitGroup(group=hanging)
    copies = [
        asyncio.create_task(client.request(submit, timeout_s=6 * HUNG_CHECK_TIMEOUT_S))
        for client in clients[:2]
    ]
    done, (checked,) = await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
    [busy] = [copy.result() for copy in done]
    assert isinstance(busy, protocol.Error) and busy.code == "busy", busy
    # Meanwhile the trainer serves: another group, a status query.
    served = await clients[2].request(protocol.SubmitGroup(group=make_group("served")))
    assert isinstance(served, protocol.GroupAck) and served.status == "accepted", served
    status = await clients[2].request(protocol.GroupStatusQuery(group_ids=["served", "hanging"]))
    assert status.statuses == {"served": "queued", "hanging": "unknown"}
    assert not checked.done()
    # Given up: the group is accepted with the rewards it was sent with.
    ack = await checked
    assert isinstance(ack, protocol.GroupAck) and ack.status == "accepted", ack
    for client in clients:
        client.close()
