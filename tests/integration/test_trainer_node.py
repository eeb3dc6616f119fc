"""A real trainer process (tiny model, hivemind) driven over ZMQ like a rollout node would.

Checks what a peer sees: duplicates and stale groups are acknowledged but never queued
twice, malformed and oversized input is answered and counted while the node keeps serving,
a full queue says "busy", and the published policy arrives in chunks whose checksum holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from safetensors.torch import load_file as load_safetensors

from agentjet import protocol
from agentjet.config import load_config, to_toml
from agentjet.errors import ProtocolError
from agentjet.identity import NodeKeys, read_node_keys
from agentjet.metrics import read_metrics
from agentjet.protocol import pack_ids
from agentjet.transport import Client, PeerUnavailable
from node.trainer_link import fetch_chunks
from node.weights import WeightAssembly
from tests import procs
from tests.factories import make_group, tiny_trainer_settings

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 1 << 20
QUEUE_BOUND = 3
# The node the test clients are: tests.factories.make_group's groups name it.
TEST_NODE = "test-node"


@dataclass
class Launched:
    """A trainer process serving on `endpoint`, of the swarm whose root is `keys_file`."""

    endpoint: str
    keys_file: Path
    proc: subprocess.Popen[bytes]
    run_dir: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def member(self, name: str = TEST_NODE) -> NodeKeys:
        """The keys of a node of this swarm named `name` (certified by the root file)."""
        return read_node_keys(self.keys_file, name)

    def stop(self) -> dict[str, Any]:
        """SIGTERM, expect a clean exit, and return the trainer's final metrics row."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.log_path.read_text()[-3000:]
        rows = read_metrics(self.run_dir / "metrics" / "trainer.jsonl")
        stopped = [r for r in rows if r.get("event") == "stopped"]
        assert stopped, "the trainer wrote no final metrics row"
        return stopped[0]


@pytest.fixture
def trainer(tiny_model_dir: Path, tmp_path: Path, keys_file: Path) -> Iterator[Launched]:
    overrides = [
        f"net.max_message_bytes={MAX_MESSAGE_BYTES}",
        "net.weight_chunk_bytes=65536",
        "rollout.group_size=2",
        # groups_per_step above the queue bound: nothing trains, the queue stays put
        f"trainer.groups_per_step={QUEUE_BOUND + 1}",
        f"trainer.max_queued_groups={QUEUE_BOUND}",
    ]
    with launched_trainer(tiny_model_dir, tmp_path, keys_file, overrides) as launched:
        yield launched


@contextlib.contextmanager
def launched_trainer(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path, overrides: list[str]
) -> Iterator[Launched]:
    """A trainer process of the tiny model with the swarm keys in `keys_file`, on an ipc
    endpoint, its run dir tmp_path/run and its log tmp_path/trainer.log; reaped by PID."""
    socket_dir = Path(tempfile.mkdtemp(prefix="aj-", dir="/tmp"))
    endpoint = f"ipc://{socket_dir}/trainer.ipc"
    config = load_config(
        None,
        [
            *tiny_trainer_settings(tiny_model_dir, endpoint, keys_file, tmp_path / "run"),
            *overrides,
        ],
    )
    path = tmp_path / "trainer.toml"
    path.write_text(to_toml(config))
    log_path = tmp_path / "trainer.log"
    log = open(log_path, "wb")  # noqa: SIM115
    proc = procs.popen(
        [
            sys.executable,
            "-m",
            "agentjet_app.cli",
            "node",
            "--role",
            "trainer",
            "--config",
            str(path),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield Launched(endpoint, keys_file, proc, tmp_path / "run", log_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


async def connect(
    trainer: Launched,
    protocol_version: int = protocol.PROTOCOL_VERSION,
    keys: NodeKeys | None = None,
    name: str = TEST_NODE,
) -> Client:
    """A client of node `name` of the trainer's swarm (or with `keys`), once the trainer
    answers."""
    keys = keys or trainer.member(name)
    client = Client(
        trainer.endpoint,
        protocol.trainer_reply_decoder,
        protocol.Hello(node_id=keys.name, role="rollout", protocol_version=protocol_version),
        MAX_MESSAGE_BYTES,
        REPLY_TIMEOUT_S,
        keys,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            await client.request(protocol.PolicyQuery())
            return client
        except PeerUnavailable:
            if time.monotonic() > deadline:
                raise


def raw_request(trainer: Launched, payload: bytes) -> protocol.TrainerReply:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        trainer.member().secure_client(sock)
        sock.connect(trainer.endpoint)
        sock.send(payload)
        assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply to a malformed message"
        return protocol.trainer_reply_decoder.decode(sock.recv())


def test_trainer_acks_dedupes_rejects_and_serves_weights(trainer: Launched, tiny_model_dir: Path):

    async def scenario() -> None:
        client = await connect(trainer)
        # a group meant for another trainer (the one this may have replaced on its endpoint)
        meant = protocol.SubmitGroup(group=make_group("a"), trainer_id="trainer-dead-1-abc")
        refused_here = await client.request(meant)
        assert isinstance(refused_here, protocol.Error) and refused_here.code == "gone"
        ack = await client.request(protocol.SubmitGroup(group=make_group("a")))
        assert ack.status == "accepted" and ack.policy_version == 0
        again = await client.request(protocol.SubmitGroup(group=make_group("a")))
        assert again.status == "duplicate"

        # a group newer than this trainer: queued (only other trainers' directory records,
        # never a group's claim, make a trainer download the swarm's state)
        future = await client.request(protocol.SubmitGroup(group=make_group("f", version=5)))
        assert future.status == "accepted"
        bad = make_group("bad")
        bad.samples[0].completion_ids = pack_ids([7, 10**6])
        refused = await client.request(protocol.SubmitGroup(group=bad))
        assert refused.status == "rejected" and "vocabulary" in refused.reason
        # a group of a policy this trainer does not train ([[policies]]): refused, not queued
        other = msgspec.structs.replace(make_group("planner-group"), policy="planner")
        refused = await client.request(protocol.SubmitGroup(group=other))
        assert refused.status == "rejected" and "policy 'planner'" in refused.reason

        for gid in ("b",):
            assert (
                await client.request(protocol.SubmitGroup(group=make_group(gid)))
            ).status == "accepted"
        busy = await client.request(protocol.SubmitGroup(group=make_group("d")))
        assert isinstance(busy, protocol.Error) and busy.code == "busy"

        # held groups are "queued" until trained; unseen and refused ones are "unknown"
        status = await client.request(protocol.GroupStatusQuery(group_ids=["a", "f", "bad", "zz"]))
        assert isinstance(status, protocol.GroupStatus)
        assert status.statuses == {"a": "queued", "f": "queued", "bad": "unknown", "zz": "unknown"}
        too_many = protocol.GroupStatusQuery(group_ids=["g"] * (protocol.MAX_STATUS_IDS + 1))
        assert (await client.request(too_many)).code == "invalid"

        # junk, truncation and oversize get an answer, and the node keeps serving
        for payload in (
            b"\x00junk",
            protocol.encode(protocol.SubmitGroup(group=make_group("x")))[:-5],
            msgspec.msgpack.encode({"t": "weight_chunk_request", "version": "zero"}),
            b"\x01" * (MAX_MESSAGE_BYTES + 10),
        ):
            reply = raw_request(trainer, payload)
            assert isinstance(reply, protocol.Error) and reply.code == "decode"

        # the base policy (version 0) is sealed: its key and manifest come over CURVE, its
        # chunks from an endpoint without CURVE that gives them only for the version's ticket
        info = await client.request(protocol.PolicyQuery())
        assert info.version == 0 and info.num_chunks > 1 and info.key and info.sealed_endpoint
        stranger = Client(
            info.sealed_endpoint,
            protocol.trainer_reply_decoder,
            protocol.Hello(node_id="stranger", role="rollout"),
            MAX_MESSAGE_BYTES,
            REPLY_TIMEOUT_S,
        )
        for asked in (
            protocol.WeightChunkRequest(version=0, index=0),
            protocol.WeightChunkRequest(version=0, index=0, ticket=bytes(len(info.ticket))),
            protocol.PolicyQuery(),
            protocol.SubmitGroup(group=make_group("s")),
        ):
            refused = await stranger.request(asked)
            assert isinstance(refused, protocol.Error), asked
        sealed = await stranger.request(
            protocol.WeightChunkRequest(version=0, index=0, ticket=info.ticket)
        )
        assert len(sealed.data) == info.chunk_bytes + 16  # ciphertext and its tag
        stranger.close()
        # ... and arrives whole and verified, each chunk checked against the manifest
        assembly = WeightAssembly.of(info)
        await fetch_chunks(assembly, info, client)
        state = assembly.finish()
        base = load_safetensors(tiny_model_dir / "model.safetensors")
        assert torch.equal(state["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
        gone = await client.request(protocol.WeightChunkRequest(version=9, index=0))
        assert isinstance(gone, protocol.Error) and gone.code == "gone"
        client.close()

        old = Client(
            trainer.endpoint,
            protocol.trainer_reply_decoder,
            protocol.Hello(node_id="old", role="rollout", protocol_version=0),
            MAX_MESSAGE_BYTES,
            REPLY_TIMEOUT_S,
            trainer.member("old"),
        )
        with pytest.raises(ProtocolError, match="protocol version 0"):
            await old.request(protocol.PolicyQuery())
        old.close()

    asyncio.run(scenario())
    assert trainer.stop()["counts/rejected_messages"] >= 3


def test_dynamic_sampling_leaves_out_groups_whose_rewards_agree_and_a_late_step_goes_short(
    tiny_model_dir: Path, tmp_path: Path, keys_file: Path
) -> None:
    """trainer.dynamic_sampling: zero-variance groups are acked "zero_variance" (final,
    even with the queue full) and never trained; a step short of groups_per_step varied
    groups trains what it holds once trainer.fill_timeout_s has passed."""
    overrides = [
        "rollout.group_size=2",
        "trainer.dynamic_sampling=true",
        "trainer.fill_timeout_s=3",
        "trainer.groups_per_step=4",
        "trainer.max_queued_groups=2",
        "trainer.checkpoint_every=1",
        "trainer.max_logprob_gap=0",  # the factory's logprobs are not the tiny model's
    ]
    agree, vary = (1.0, 1.0), (1.0, 0.0)
    with launched_trainer(tiny_model_dir, tmp_path, keys_file, overrides) as trainer:

        async def scenario() -> dict[str, str]:
            client = await connect(trainer)

            async def submit(group_id: str, rewards: tuple[float, ...]) -> object:
                group = make_group(group_id, rewards=rewards)
                return await client.request(protocol.SubmitGroup(group=group))

            assert (await submit("z1", agree)).status == "zero_variance"
            assert (await submit("a", vary)).status == "accepted"
            assert (await submit("b", vary)).status == "accepted"
            busy = await submit("c", vary)
            assert isinstance(busy, protocol.Error) and busy.code == "busy"
            # left out needs no room in the queue
            assert (await submit("z2", (0.0, 0.0))).status == "zero_variance"
            assert (await submit("z1", agree)).status == "duplicate"
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # the step goes short after fill_timeout_s and is checkpointed
                reply = await client.request(protocol.GroupStatusQuery(group_ids=["a", "b", "z1"]))
                if reply.statuses["a"] != "queued" or time.monotonic() > deadline:
                    break
            client.close()
            return reply.statuses

        statuses = asyncio.run(scenario())
        assert statuses == {"a": "trained", "b": "trained", "z1": "dropped"}
        final = trainer.stop()
    assert final["counts/groups_zero_variance"] == 2 and final["counts/steps_short"] == 1
    rows = read_metrics(trainer.run_dir / "metrics" / "trainer.jsonl")
    [step] = [r for r in rows if r.get("event") == "step"]
    assert step["short_step"] and step["groups_left_out"] == 2
    assert sorted(step["trained_group_ids"]) == ["a", "b"] and step["policy_version"] == 1
    left_out = [g for r in rows for g in r.get("zero_variance_group_ids", [])]
    assert sorted(left_out) == ["z1", "z2"]
