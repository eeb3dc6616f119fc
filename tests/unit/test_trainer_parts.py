"""The trainer's parts on their own, without a trainer role: what it takes in
(node/trainer_intake.py) and where it starts from (node/trainer_lineage.py). Hand-made
groups and records; the groups' fates as a rollout node would see them in the acks."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch

from agentjet import protocol
from agentjet.config import Config, TrainerConfig
from agentjet.errors import ModelError
from agentjet.metrics import MetricsWriter
from node.groups import Filling, GroupBook
from node.publisher import Publisher
from node.replay import Replay
from node.trainer_intake import Head, Intake
from node.trainer_lineage import (
    LINEAGES_LOG,
    load_params,
    record_lineage,
    start_lineage,
    swarm_lineage,
    used_lineages,
)
from node.verify import Quarantine, RewardCheck
from node.weights import snapshot
from tests.factories import make_group

pytestmark = pytest.mark.unit


def intake_of(tmp_path: Path, quarantine_after: int = 3, max_policy_lag: int = 2) -> Intake:
    """An intake of trainer-a at version 5, with parts of its own (tests/unit/test_trainer_loop.py
    builds the other parts over them)."""
    config = Config(trainer=TrainerConfig(quarantine_after=quarantine_after))
    config.trainer.max_policy_lag = max_policy_lag
    model = torch.nn.Linear(2, 2)
    first = snapshot(model, 0, 1 << 20, torch.float32, False)
    return Intake(
        config=config,
        policy="",
        node_id="trainer-a",
        head=Head(version=5),
        book=GroupBook(),
        replay=Replay(config.trainer),
        quarantine=Quarantine(quarantine_after),
        reward_check=RewardCheck([], config.trainer, b"secret"),
        filling=Filling(0.0),
        batch_ready=asyncio.Event(),
        publisher=Publisher(first, config.swarm.run_id),
        metrics=MetricsWriter(tmp_path, "trainer"),
        counts=Counter(),
        tokenizer=None,
        vocab_size=100,
        teacher_coefs={},
    )


def _submit(intake: Intake, group: protocol.TrajectoryGroup, to: str = "") -> object:
    return asyncio.run(intake.receive(protocol.SubmitGroup(group=group, trainer_id=to)))


def test_a_fresh_group_is_queued_and_acked_at_the_trainers_version(tmp_path: Path) -> None:
    intake = intake_of(tmp_path)
    ack = _submit(intake, make_group("g1", version=4))
    assert isinstance(ack, protocol.GroupAck)
    assert (ack.status, ack.policy_version) == ("accepted", 5)
    assert intake.book.status("g1") == "queued"
    assert intake.counts["groups_accepted"] == 1
    again = _submit(intake, make_group("g1", version=4))  # (its ack was lost)
    assert isinstance(again, protocol.GroupAck) and again.status == "duplicate"


def test_a_group_for_another_trainer_or_policy_is_not_taken(tmp_path: Path) -> None:
    intake = intake_of(tmp_path)
    gone = _submit(intake, make_group("g1"), to="trainer-b")
    assert isinstance(gone, protocol.Error) and gone.code == "gone"
    other = msgspec_replace(make_group("g2"), policy="solver")
    ack = _submit(intake, other)
    assert isinstance(ack, protocol.GroupAck) and ack.status == "rejected"
    assert "policy 'solver'" in ack.reason
    assert intake.book.status("g1") == intake.book.status("g2") == "unknown"


def test_a_group_older_than_the_lag_bound_is_dropped_with_a_row_first(tmp_path: Path) -> None:
    intake = intake_of(tmp_path, max_policy_lag=2)
    ack = _submit(intake, make_group("old", version=2))  # 3 versions behind 5
    assert isinstance(ack, protocol.GroupAck) and ack.status == "stale"
    intake.metrics.close()
    lines = (tmp_path / "metrics/trainer.jsonl").read_text().splitlines()
    row = json.loads(lines[-1])
    assert (row["event"], row["policy_version"], row["stale_group_ids"]) == ("stale", 5, ["old"])
    assert intake.book.status("old") != "queued"


def test_failed_checks_quarantine_the_node_and_its_groups_are_refused(tmp_path: Path) -> None:
    intake = intake_of(tmp_path, quarantine_after=2)
    intake.hold_against("test-node", "logprob gap 3 over trainer.max_logprob_gap=0.5")
    intake.hold_against("test-node", "logprob gap 4 over trainer.max_logprob_gap=0.5")
    assert intake.counts["nodes_quarantined"] == 1
    ack = _submit(intake, make_group("g9"))
    assert isinstance(ack, protocol.GroupAck) and ack.status == "rejected"
    assert intake.counts["groups_refused_quarantined"] == 1


def test_status_queries_answer_from_the_book_at_the_current_head(tmp_path: Path) -> None:
    intake = intake_of(tmp_path)
    _submit(intake, make_group("g1", version=5))
    intake.head.version = 6  # (a step moved it)
    reply = intake.answer(protocol.GroupStatusQuery(group_ids=["g1", "nope"]))
    assert isinstance(reply, protocol.GroupStatus)
    assert reply.statuses == {"g1": "queued", "nope": "unknown"}
    assert reply.policy_version == 6


def msgspec_replace(group: protocol.TrajectoryGroup, **changes: str) -> protocol.TrajectoryGroup:
    return msgspec.structs.replace(group, **changes)


def _record(node_id: str, version: int, lineage: protocol.Lineage) -> protocol.NodeRecord:
    return protocol.NodeRecord(
        node_id=node_id, role="trainer", policy_version=version, lineage=lineage
    )


def test_a_first_start_is_the_root_lineage_and_a_restart_forks(tmp_path: Path) -> None:
    lineage, resumed = start_lineage(None, [], tmp_path)
    assert (lineage, resumed) == (protocol.Lineage(), -1)
    record_lineage(tmp_path, lineage)
    assert used_lineages(tmp_path) == {""}
    # the same run dir started again from the base weights: the root is taken
    again, _ = start_lineage(None, [], tmp_path)
    assert again != lineage and again.id != ""
    record_lineage(tmp_path, again)
    third, _ = start_lineage(None, [], tmp_path)
    assert third.id not in {"", again.id}
    assert (tmp_path / LINEAGES_LOG).read_text().split("\n")[:-1] == ["", again.id]


def test_a_resume_forks_its_checkpoints_lineage_at_its_version(tmp_path: Path) -> None:
    parent = protocol.Lineage()
    resume = {"policy_version": 7, "lineage": {}}
    lineage, resumed = start_lineage(resume, [], tmp_path)
    assert resumed == 7 and lineage.id != parent.id
    # a live trainer already published that fork past version 7: the next fork
    taken = _record("trainer-b", 9, lineage)
    other, _ = start_lineage(resume, [taken], tmp_path)
    assert other.id != lineage.id
    # ... but one listed at version 7 itself does not hold it past the checkpoint
    same, _ = start_lineage(resume, [_record("trainer-b", 7, lineage)], tmp_path)
    assert same.id == lineage.id


def test_the_swarms_lineage_is_the_newest_trainers() -> None:
    old, new = protocol.Lineage().fork(1, 0), protocol.Lineage().fork(3, 0)
    records = [_record("a", 4, old), _record("b", 9, new)]
    assert swarm_lineage(records, protocol.Lineage()) == new
    assert swarm_lineage([], old) == old


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ModelError, match="another model"):
        load_params(model, {"weight": torch.zeros(3, 3), "bias": torch.zeros(2)}, tmp_path)
    load_params(model, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, tmp_path)
    assert torch.equal(model.weight, torch.ones(2, 2))
