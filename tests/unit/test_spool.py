"""The rollout node's on-disk spool: every held group survives a restart, within a cap."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentjet import protocol
from agentjet.errors import ConfigError
from node.delivery import Ledger, TrainerPeer
from node.spool import Spool, SpoolFull
from tests.factories import make_group

pytestmark = pytest.mark.unit


def test_groups_held_by_the_ledger_come_back_after_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    ledger = Ledger(rng=random.Random(0), spool=spool)
    for g in ("a", "b", "c"):
        ledger.add(make_group(g))
    trainer = TrainerPeer("t", "tcp://h:1")
    for pending in ledger.to_offer():
        ack = protocol.GroupAck(
            group_id=pending.group.group_id, status="accepted", policy_version=0
        )
        ledger.offered(pending, trainer, ack, now=0.0)
    ledger.statuses("t", {"a": "trained", "b": "dropped", "c": "queued"})
    spool.close()  # the node stops (or dies: the files are all that is left)

    again = Spool(tmp_path, max_bytes=1 << 20)
    [(restored, holder)] = again.load()
    assert restored == make_group("c") and holder == "t"  # trainer t accepted it
    assert again.nbytes == len(protocol.encode(restored))
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".group", ".holder", ".lock"]


def test_a_restored_group_goes_back_only_to_the_trainer_that_held_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    ledger = Ledger(rng=random.Random(0), spool=spool)
    ledger.add(make_group("g"))
    [pending] = ledger.to_offer()
    held_by_a = protocol.GroupAck(group_id="g", status="accepted", policy_version=0)
    ledger.offered(pending, TrainerPeer("a", "tcp://h:1"), held_by_a, now=0.0)
    spool.close()

    again = Spool(tmp_path, max_bytes=1 << 20)
    restored = Ledger(rng=random.Random(0), spool=again)
    for group, holder in again.load():
        restored.add(group, write=False, holder=holder)
    trainers = {t: TrainerPeer(t, f"tcp://h:{i}") for i, t in enumerate(("a", "b"))}
    [pending] = restored.to_offer()
    for _ in range(10):  # never the less loaded b: a may have it queued
        assert restored.pick(pending, trainers, now=0.0) is trainers["a"]
    # a is gone, and no mark says trained: it goes to another trainer
    assert restored.trainer_gone("a", trained=set()) == {"trained": 0, "resent": 1, "waiting": 0}
    assert restored.pick(pending, {"b": trainers["b"]}, now=0.0) is trainers["b"]


def test_a_group_offered_before_a_crash_goes_back_only_to_the_trainer_offered_to(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    ledger = Ledger(rng=random.Random(0), spool=spool)
    ledger.add(make_group("g"))
    [pending] = ledger.to_offer()
    ledger.offering(pending, TrainerPeer("a", "tcp://h:1"))
    spool.close()  # killed while the offer was on its way: a may have queued it

    again = Spool(tmp_path, max_bytes=1 << 20)
    [(group, holder)] = again.load()
    assert group == make_group("g") and holder == "a"


def test_a_full_spool_refuses_a_group_and_writes_nothing(tmp_path: Path) -> None:
    size = len(protocol.encode(make_group("a")))
    spool = Spool(tmp_path, max_bytes=2 * size)
    spool.put(make_group("a"))
    spool.put(make_group("b"))
    assert spool.full()
    with pytest.raises(SpoolFull, match="spool_max_bytes"):
        spool.put(make_group("c"))
    assert len(list(tmp_path.glob("*.group"))) == 2
    spool.remove("a")
    assert not spool.full()
    spool.put(make_group("c"))
    spool.close()
    assert sorted(g.group_id for g, _ in Spool(tmp_path, 1 << 20).load()) == ["b", "c"]


def test_a_damaged_file_is_set_aside_not_loaded_and_not_deleted(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.put(make_group("a"))
    spool.put(make_group("b"))
    spool.close()
    [victim] = [p for p in tmp_path.glob("*.group") if p.read_bytes().find(b"\xa1a") >= 0]
    victim.write_bytes(victim.read_bytes()[:20])  # cut short
    renamed = tmp_path / "0123.group"  # a file that names another group than it holds
    next(p for p in tmp_path.glob("*.group") if p != victim).rename(renamed)
    (tmp_path / "x.group.tmp").write_bytes(b"half")  # a write the crash cut short

    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.load() == []
    assert again.corrupt == 2
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.name != "spool.lock") == [
        ".corrupt",
        ".corrupt",
    ]


def test_two_nodes_cannot_share_a_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(
        ConfigError, match=r"is held by a live rollout node \(pid \d+\): stop that one"
    ):
        Spool(tmp_path, max_bytes=1 << 20)
    first.close()
    Spool(tmp_path, max_bytes=1 << 20).close()


def test_a_hostile_group_id_cannot_name_a_path_outside_the_spool(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    spool.put(make_group("../../etc/passwd"))
    assert [p.parent for p in (tmp_path / "spool").glob("*.group")] == [tmp_path / "spool"]
    assert [g.group_id for g, _ in spool.load()] == ["../../etc/passwd"]
