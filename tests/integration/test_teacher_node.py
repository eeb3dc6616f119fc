"""A teacher node (node/teacher_node.py) on its CURVE socket, with the real tiny model and
its own DHT peer, and rollout nodes' side of it (node/teacher.py `TeacherNodes`): scores as
the rollout node's own teacher would give them, a group held while no teacher node answers
and scored once one does, a dead node passed over, and hostile requests answered with one
error each while the node serves on. The swarm with a teacher node killed and restarted
mid-run: tests/integration/test_swarm.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from agentjet import protocol
from agentjet.config import EnvConfig, ModelConfig, NetConfig, load_config
from agentjet.identity import read_node_keys
from agentjet.ports import free_port
from agentjet.transport import Client
from node.teacher import LocalTeachers, TeacherNodes
from node.teacher_node import TeacherNode
from node.torch_engine import TorchEngine
from tests.factories import member_hello
from tests.unit.test_dashboard_swarm import serving
from tests.unit.test_distill import TEMPERATURE, played_groups

pytestmark = pytest.mark.integration

# Bound on any wait here (a CPU prefill of a few short samples takes well under a second).
WAIT_S = 60.0


def start_teacher_node(
    cleanup: ExitStack, run_dir: Path, model_dir: Path, keys_file: Path
) -> TeacherNode:
    config = load_config(
        None,
        [
            f"model.name={json.dumps(str(model_dir))}",
            f"net.keys={json.dumps(str(keys_file))}",
            f"run.dir={json.dumps(str(run_dir))}",
            "swarm.run_id=teacher-test",
        ],
    )
    role = TeacherNode(config, [str(model_dir)])
    role.setup(cleanup)
    return role


@pytest.fixture
def teacher_node(
    tmp_path: Path, tiny_model_dir: Path, keys_file: Path, one_torch_thread: None
) -> Iterator[TeacherNode]:
    with ExitStack() as cleanup:
        yield start_teacher_node(cleanup, tmp_path / "teacher", tiny_model_dir, keys_file)


def record(role: TeacherNode, queue: int = 0) -> protocol.NodeRecord:
    return protocol.NodeRecord(
        node_id=role.node_id,
        role="teacher",
        endpoint=role.endpoint,
        queue=queue,
        teachers=role.names,
    )


def rollout_side(
    teacher: Path, keys_file: Path, timeout_s: float = 30.0, top_k: int = 0
) -> TeacherNodes:
    keys = read_node_keys(keys_file, "rollout-a")
    envs = [
        EnvConfig(name="arithmetic", teacher=str(teacher), teacher_top_k=top_k),
        EnvConfig(name="python_code"),
    ]
    hello = protocol.Hello(node_id=keys.name, role="rollout")
    net = NetConfig(keys=str(keys_file))
    vocab = json.loads((teacher / "config.json").read_text())["vocab_size"]
    return TeacherNodes(envs, hello, net, keys, TEMPERATURE, timeout_s, vocab)


def test_teacher_nodes_score_a_batch_side_by_side_as_the_rollout_nodes_own_teacher_would(
    teacher_node: TeacherNode, tiny_model_dir: Path, keys_file: Path, tmp_path: Path
):
    """With a top k (envs[].teacher_top_k): the nodes send it too, as the local one makes it."""
    engine = TorchEngine(tiny_model_dir, seed=1)
    groups = played_groups(engine, (1.0, 0.0, 0.0))
    envs = [EnvConfig(name="arithmetic", teacher=str(tiny_model_dir), teacher_top_k=4)]
    local = LocalTeachers(envs, ModelConfig(), engine.tokenizer, engine.device, TEMPERATURE)
    nodes = rollout_side(tiny_model_dir, keys_file, top_k=4)

    async def main(other: TeacherNode) -> list[tuple[protocol.TrajectoryGroup, float]]:
        async with serving(teacher_node), serving(other):
            nodes.update([record(teacher_node), record(other)])
            try:  # the batch's groups at once: each to the node with fewer in flight
                return await nodes.score_all(groups)
            finally:
                nodes.close()

    with ExitStack() as cleanup:
        other = start_teacher_node(cleanup, tmp_path / "other", tiny_model_dir, keys_file)
        results = asyncio.run(main(other))
    # two groups at once, two nodes: one each (the second went to the node with none in flight)
    assert [teacher_node.counts["samples_scored"], other.counts["samples_scored"]] == [
        len(groups[0].samples),
        len(groups[1].samples),
    ]
    for group, (scored, kl) in zip(groups, results, strict=True):
        here, here_kl = local.score_now(group)
        assert kl == pytest.approx(here_kl, abs=1e-5)
        assert protocol.check_group(scored, engine.vocab_size, 4096) is None
        for a, b in zip(scored.samples, here.samples, strict=True):
            for key in ("teacher_logprobs", "teacher_top_logprobs"):
                np.testing.assert_allclose(
                    protocol.unpack_floats(getattr(a, key)),
                    protocol.unpack_floats(getattr(b, key)),
                    atol=1e-5,
                )
            assert protocol.top_k_of(a.teacher_top_ids, len(a.loss_mask)) == 4
            assert a.teacher_top_ids == b.teacher_top_ids
    assert nodes.held == 0
    rows = [
        (Path(role.config.run.dir) / "metrics" / "teacher.jsonl").read_text()
        for role in (teacher_node, other)
    ]
    assert sum(r.count('"event": "scored"') for r in rows) == len(groups)


def test_a_group_is_held_until_a_teacher_node_answers_and_a_dead_one_is_passed_over(
    teacher_node: TeacherNode, tiny_model_dir: Path, keys_file: Path
):
    engine = TorchEngine(tiny_model_dir, seed=1)
    [group, _] = played_groups(engine, (1.0, 0.0))
    nodes = rollout_side(tiny_model_dir, keys_file, timeout_s=1.0)
    # listed, least loaded, and dead: nothing listens on its port
    dead = protocol.NodeRecord(
        node_id="teacher-dead",
        role="teacher",
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        teachers=[str(tiny_model_dir)],
    )

    async def main() -> tuple[protocol.TrajectoryGroup, float]:
        async with serving(teacher_node):
            try:
                task = asyncio.create_task(nodes.score(group))
                # no teacher node listed: the group waits (held), it is not dropped
                async with asyncio.timeout(WAIT_S):
                    while nodes.held == 0:
                        await asyncio.sleep(0.05)  # polling the counter the node reports
                assert not task.done()
                nodes.update([dead, record(teacher_node, queue=3)])
                return await asyncio.wait_for(task, WAIT_S)
            finally:
                nodes.close()

    scored, _ = asyncio.run(main())
    assert nodes.held == 1
    assert all(len(s.teacher_logprobs) == len(s.completion_ids) for s in scored.samples)
    assert [s.completion_ids for s in scored.samples] == [s.completion_ids for s in group.samples]


def test_hostile_requests_get_one_error_each_and_the_node_serves_on(
    teacher_node: TeacherNode, tiny_model_dir: Path, keys_file: Path
):
    keys = read_node_keys(keys_file, "rollout-h")
    good = protocol.TeacherInput(
        prompt_ids=protocol.pack_ids([1, 2, 3]),
        completion_ids=protocol.pack_ids([4, 5]),
        loss_mask=protocol.pack_mask([1, 1]),
    )
    name = str(tiny_model_dir)
    vocab = teacher_node.vocab_size

    def ask(
        teacher: str = name, temperature: float = 0.7, samples=(good,), top_k: int = 0
    ) -> object:
        return protocol.TeacherScoreRequest(
            node_id=keys.name,
            teacher=teacher,
            temperature=temperature,
            samples=list(samples),
            top_k=top_k,
        )

    hostile = [
        (ask(teacher="/elsewhere/model"), "no teacher '/elsewhere/model' here"),
        (ask(temperature=float("nan")), "temperature nan"),
        (ask(temperature=0.0), "temperature 0.0"),
        (ask(samples=()), "0 samples"),
        (ask(top_k=-1), "top k -1"),
        (ask(top_k=protocol.MAX_TOP_K + 1), f"top k {protocol.MAX_TOP_K + 1}"),
        (ask(samples=[good] * 1025), "1025 samples"),
        (
            ask(samples=[protocol.msgspec.structs.replace(good, completion_ids=b"\x01\x02")]),
            "not whole int32",
        ),
        (
            ask(samples=[protocol.msgspec.structs.replace(good, loss_mask=b"\x01")]),
            "loss_mask length differs",
        ),
        (
            ask(
                samples=[
                    protocol.msgspec.structs.replace(good, prompt_ids=protocol.pack_ids([vocab]))
                ]
            ),
            "outside the vocabulary",
        ),
        (
            ask(
                samples=[protocol.msgspec.structs.replace(good, prompt_ids=protocol.pack_ids([-1]))]
            ),
            "outside the vocabulary",
        ),
        (
            ask(
                samples=[
                    protocol.msgspec.structs.replace(good, prompt_ids=protocol.pack_ids([1] * 9000))
                ]
            ),
            "9002 tokens",
        ),
    ]

    async def main() -> list[object]:
        async with serving(teacher_node):
            client = Client(
                teacher_node.endpoint,
                protocol.teacher_reply_decoder,
                member_hello(keys),
                1 << 26,
                WAIT_S,
                keys,
            )
            try:
                replies = [await client.request(msg) for msg, _ in hostile]
                return [*replies, await client.request(ask())]
            finally:
                client.close()

    *refused, served = asyncio.run(main())
    for reply, (_, why) in zip(refused, hostile, strict=True):
        assert isinstance(reply, protocol.Error) and reply.code == "invalid", reply
        assert why in reply.message, (why, reply.message)
    assert isinstance(served, protocol.TeacherScores) and len(served.logprobs) == 1
    assert protocol.check_logprobs(served.logprobs[0], 2, "scores") is None
    assert teacher_node.counts["requests_refused"] == len(hostile)
