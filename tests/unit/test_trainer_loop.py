"""The parts a trainer's loops drive, each on its own, without a trainer role: its view of
the other trainers (node/trainer_peers.py), its record and counts (trainer_status.py),
catching up with the swarm (trainer_catch_up.py), doubtful batches settled
(trainer_doubtful.py) and its steps (trainer_step.py). Real books, replays, publishers and
metrics; the DHT's directory, the swarm's optimizer and the learner are small fakes that
answer as the real ones would."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from agentjet import protocol
from agentjet.config import Config, ReplayConfig, SwarmConfig, TrainerConfig
from agentjet.metrics import MetricsWriter
from agentjet.transport import Server
from node.directory import Directory, Mark
from node.gpu_monitor import GpuMonitor
from node.groups import TRAINED_LOG, DoubtfulBatch, GroupBook
from node.learner import Learner, StepResult
from node.publisher import Publisher
from node.replay import Replay
from node.rounds import StepOutcome
from node.swarm import SwarmOptimizer
from node.trainer_catch_up import CatchUp
from node.trainer_doubtful import Doubtful
from node.trainer_intake import Head, Intake
from node.trainer_lineage import used_lineages
from node.trainer_peers import Peers
from node.trainer_status import Status
from node.trainer_step import Step
from node.trainer_versions import Versions
from node.weights import snapshot
from tests.factories import make_group
from tests.unit.test_trainer_parts import intake_of

pytestmark = pytest.mark.unit

NODE = "trainer-a"
OWN_PEER = "QmOwnPeer"
FORKED = protocol.Lineage().fork(3, 0)


class FakeDirectory:
    """The directory as the trainer's parts call it, in memory: the records it lists, the
    batches marked trained, and what was stored."""

    def __init__(self, records: list[protocol.NodeRecord] | None = None) -> None:
        self.listed = records or []
        self.published: list[protocol.NodeRecord] = []
        self.marked: set[str] = set()
        self.unreadable = False  # marks cannot be read (a DHT timeout)
        self.marks: list[tuple[list[str], Mark, tuple[str, ...]]] = []

    def publish(self, record: protocol.NodeRecord) -> bool:
        self.published.append(record)
        return True

    def records_seen_by(self, node_id: str) -> list[protocol.NodeRecord]:
        return list(self.listed)

    def marked_batches(self, batch_ids: list[str]) -> set[str]:
        if self.unreadable:
            raise TimeoutError("the DHT did not answer")
        return self.marked & set(batch_ids)

    def mark_trained(self, group_ids: list[str], mark: Mark, batch_ids: tuple[str, ...]) -> None:
        self.marks.append((list(group_ids), mark, batch_ids))

    def record_checkpoint(self, peer_id: str, mark: Mark) -> None:
        pass


@dataclass
class FakeSwarm:
    """The swarm's optimizer as the parts read it; a state download moves it to `ahead`."""

    epoch: int = 5
    ahead: int | None = None  # the version a state download brings (None: none comes)
    withheld: bool = False
    round_problem: str = ""
    downloads: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def load_state_from_peers(self) -> bool:
        self.downloads += 1
        if self.ahead is None:
            return False
        self.epoch = self.ahead
        return True

    def refusals(self) -> dict[str, int]:
        return self.refused

    def counts(self) -> dict[str, int]:
        return {"rounds_failed": 2}


class FakeVersions:
    """Versions published and checkpointed, as the step calls them."""

    def __init__(self, head: Head) -> None:
        self.head = head
        self.published: list[int] = []
        self.checkpoints: list[int] = []

    async def publish(self) -> None:
        self.published.append(self.head.version)

    def checkpoint(self) -> None:
        self.checkpoints.append(self.head.version)


class FakeLearner:
    """A learner whose every step ends in `outcome`, leaving out `rejected` groups."""

    def __init__(self, outcome: StepOutcome, rejected: set[str] | None = None) -> None:
        self.outcome = outcome
        self.rejected = rejected or set()
        self.calls: list[tuple[list[str], int, list[str]]] = []
        self.teacher_coefs: dict[str, float] = {}

    def train_step(
        self,
        batch: list[protocol.TrajectoryGroup],
        local_batch: int,
        replays: list[protocol.TrajectoryGroup],
    ) -> StepResult:
        self.calls.append(([g.group_id for g in batch], local_batch, [g.group_id for g in replays]))
        gaps = {g.group_id: 9.0 for g in batch if g.group_id in self.rejected}
        return StepResult(self.outcome, set(self.rejected), gaps, {"charts/samples": 4.0})


def rows(tmp_path: Path, metrics: MetricsWriter) -> list[dict[str, Any]]:
    metrics.close()
    lines = (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def record(
    node_id: str,
    version: int = 5,
    policy: str = "",
    role: str = "trainer",
    maddrs: list[str] | None = None,
) -> protocol.NodeRecord:
    return protocol.NodeRecord(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        policy=policy,
        policy_version=version,
        maddrs=maddrs or [],
        lineage=FORKED,
    )


def peers_of(
    directory: FakeDirectory | None = None, config: Config | None = None, policy: str = ""
) -> Peers:
    config = config or Config()
    return Peers(
        config=config,
        policy=policy,
        node_id=NODE,
        peer_id=OWN_PEER,
        directory=cast(Directory, directory or FakeDirectory()),
        replay=Replay(config.trainer),
    )


def publisher_of(model: torch.nn.Module, version: int = 5) -> Publisher:
    return Publisher(snapshot(model, version, 1 << 20, torch.float32, False), "agentjet")


# ── Peers: the other trainers, from the heartbeat ─────────────────────────────────────


def test_the_other_trainers_are_this_policys_live_ones_only() -> None:
    peers = peers_of(policy="planner")
    records = [
        record("trainer-b", policy="planner"),
        record("trainer-c", policy="solver"),  # another policy's
        record(NODE, policy="planner"),  # this trainer's own
        record("rollout-1", policy="planner", role="rollout"),
        # this trainer's previous life, restarted on the same DHT identity
        record("trainer-old", policy="planner", maddrs=[f"/ip4/1.2.3.4/tcp/5/p2p/{OWN_PEER}"]),
    ]
    assert list(peers.others_in(records)) == ["trainer-b"]


def test_a_trainers_share_of_a_step_follows_the_live_trainers() -> None:
    peers = peers_of(config=Config(trainer=TrainerConfig(groups_per_step=8)))
    assert peers.step_share() == 8 and peers.replay.groups_per_step == 8
    peers.others = {n: record(n) for n in ("b", "c")}
    assert peers.step_share() == 3  # 8 among three trainers: the larger share
    assert peers.replay.groups_per_step == 3
    fixed = Config(
        trainer=TrainerConfig(groups_per_step=8), swarm=SwarmConfig(target_batch_size=64)
    )
    peers = peers_of(config=fixed)
    peers.others = {n: record(n) for n in ("b", "c")}
    assert peers.step_share() == 8  # a global batch of its own: every trainer takes its 8


async def beat_until(peers: Peers, done: Any, what: protocol.NodeRecord) -> None:
    heartbeat = asyncio.create_task(peers.heartbeat(lambda: what))
    try:
        for _ in range(500):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the heartbeat never got there")
    finally:
        heartbeat.cancel()


def test_the_heartbeat_lists_the_others_and_settles_after_its_second_read() -> None:
    directory = FakeDirectory([record(NODE), record("trainer-b", version=7)])
    peers = peers_of(directory, Config(swarm=SwarmConfig(heartbeat_s=0.01)))
    mine = record(NODE, version=5)
    asyncio.run(beat_until(peers, peers.settled.is_set, mine))
    assert list(peers.others) == ["trainer-b"] and peers.versions() == [7]
    assert len(directory.published) >= 2 and directory.published[0] is mine
    assert peers.connected.is_set()


def test_a_trainer_unseen_for_a_records_life_is_cut_off_until_listed_again() -> None:
    directory = FakeDirectory([])  # not even its own record comes back
    swarm = SwarmConfig(heartbeat_s=0.01, record_ttl_s=0.05, initial_peers=["/ip4/x"])
    peers = peers_of(directory, Config(swarm=swarm))
    asyncio.run(beat_until(peers, lambda: not peers.connected.is_set(), record(NODE)))
    assert not peers.settled.is_set()
    # listed again, with another node: back in touch
    directory.listed = [record(NODE), record("rollout-1", role="rollout")]
    asyncio.run(beat_until(peers, peers.connected.is_set, record(NODE)))
    # only this process's other policies listed: still cut off from the swarm
    directory.listed = [record(NODE), record(f"{NODE}/solver")]
    asyncio.run(beat_until(peers, lambda: not peers.connected.is_set(), record(NODE)))


# ── Status: the record and the counts ─────────────────────────────────────────────────


def status_of(intake: Intake, swarm: FakeSwarm, server: Server) -> Status:
    """The status of the trainer whose parts `intake` holds."""
    return Status(
        config=intake.config,
        policy=intake.policy,
        node_id=intake.node_id,
        endpoint="tcp://10.0.0.1:5555",
        maddrs=["/ip4/10.0.0.1/tcp/4000"],
        head=intake.head,
        book=intake.book,
        quarantine=intake.quarantine,
        reward_check=intake.reward_check,
        counts=intake.counts,
        swarm=cast(SwarmOptimizer, swarm),
        server=server,
        publisher=intake.publisher,
        gpu=GpuMonitor.for_devices(["cpu"]),
    )


def test_the_record_says_where_the_trainer_is_and_what_it_refused(tmp_path: Path) -> None:
    intake = intake_of(tmp_path, quarantine_after=1)
    intake.config.trainer.max_queued_groups = 32
    intake.head.lineage = FORKED
    intake.book.accept(make_group("g1", version=5))
    intake.quarantine.failed("bad-node", "wrong reward")
    intake.counts["groups_trained"] = 12
    server = Server(f"ipc://{tmp_path}/t.ipc", protocol.trainer_request_decoder, 1 << 20)
    try:
        swarm = FakeSwarm(round_problem="peers late", refused={"round_joins": 3, "state": 0})
        status = status_of(intake, swarm, server)
        server.denied = 2
        status.measured(0.0, 2.0, 8.0)
        mine = status.record()
        assert (mine.node_id, mine.policy_version, mine.lineage) == (NODE, 5, FORKED)
        assert (mine.queue, mine.capacity, mine.quarantined) == (1, 32, ["bad-node"])
        assert mine.samples_per_s == 4.0 and mine.gpus == []
        assert mine.refused == {"handshakes": 2, "round_joins": 3}
        assert mine.rounds == "peers late"
        counts = status.counts_row()
        assert counts["counts/groups_trained"] == 12
        assert counts["counts/swarm_rounds_failed"] == 2
        assert counts["counts/denied_handshakes"] == 2
        stopped = status.stopped_row()
        assert stopped["queued_group_ids"] == ["g1"] and stopped["quarantined"] == ["bad-node"]
        assert status.started_row()["lineage"] == FORKED.id
    finally:
        server.close()


# ── CatchUp: the swarm's state taken in ───────────────────────────────────────────────


@dataclass
class Caught:
    catch_up: CatchUp
    swarm: FakeSwarm
    book: GroupBook
    replay: Replay
    publisher: Publisher


def catch_up_of(tmp_path: Path, swarm: FakeSwarm, others: list[protocol.NodeRecord]) -> Caught:
    config = Config(trainer=TrainerConfig(replay=ReplayConfig(share=0.5)))
    head, book, replay = Head(version=swarm.epoch), GroupBook(), Replay(config.trainer)
    book.open_log(tmp_path / TRAINED_LOG, resumed_version=-1)  # (closed with the test's files)
    model = torch.nn.Linear(2, 2)
    versions = Versions(
        config=config,
        run_dir=tmp_path,
        head=head,
        model=model,
        tokenizer=None,
        version_dtype=torch.float32,
        swarm=cast(SwarmOptimizer, swarm),
        book=book,
        directory=cast(Directory, FakeDirectory()),
        peer_id=OWN_PEER,
    )
    publisher = versions.open_publisher(None)
    peers = peers_of()
    peers.others = {r.node_id: r for r in others}
    catch_up = CatchUp(
        run_dir=tmp_path,
        head=head,
        book=book,
        replay=replay,
        swarm=cast(SwarmOptimizer, swarm),
        peers=peers,
        versions=versions,
        publisher=publisher,
        metrics=MetricsWriter(tmp_path, "trainer"),
        counts=Counter(),
    )
    return Caught(catch_up, swarm, book, replay, publisher)


def test_catching_up_in_the_same_lineage_takes_and_serves_the_swarms_version(
    tmp_path: Path,
) -> None:
    caught = catch_up_of(tmp_path, FakeSwarm(epoch=5, ahead=8), [record("b", 8)])
    caught.catch_up.head.lineage = FORKED  # the peers' own
    caught.book.trained([make_group("g1", version=4)], 5, FORKED.id)
    asyncio.run(caught.catch_up.run())
    assert caught.catch_up.head.version == 8 and caught.publisher.published.version == 8
    assert caught.catch_up.counts["catch_ups"] == 1
    assert caught.book.seen["g1"] == "trained"  # still in the weights that go on
    [row] = rows(tmp_path, caught.catch_up.metrics)
    assert (row["event"], row["policy_version"], row["version_withheld"]) == ("caught_up", 8, False)


def test_catching_up_into_another_lineage_gives_back_the_groups_no_checkpoint_holds(
    tmp_path: Path,
) -> None:
    caught = catch_up_of(tmp_path, FakeSwarm(epoch=5, ahead=8), [record("b", 8)])
    own = make_group("g1", version=4)
    caught.book.trained([make_group("g0", version=2)], 3, "")  # in FORKED's history
    caught.book.trained([own], 5, "")
    caught.replay.add([own])
    asyncio.run(caught.catch_up.run())
    assert caught.catch_up.head.lineage == FORKED
    assert caught.book.status("g1") == "unknown"  # offered again by its rollout node
    assert caught.book.status("g0") == "queued"  # trained, durable at a checkpoint here
    assert len(caught.replay) == 0  # no importance ratio across lineages
    assert FORKED.id in used_lineages(tmp_path)


def test_no_state_downloaded_changes_nothing_and_a_withheld_one_is_not_served(
    tmp_path: Path,
) -> None:
    caught = catch_up_of(tmp_path, FakeSwarm(epoch=5, ahead=None), [record("b", 8)])
    asyncio.run(caught.catch_up.run())
    assert caught.catch_up.head.version == 5 and caught.swarm.downloads == 1
    caught.swarm.ahead, caught.swarm.withheld = 6, True
    caught.catch_up.head.lineage = FORKED
    asyncio.run(caught.catch_up.run())
    assert caught.catch_up.head.version == 6 and caught.publisher.published.version == 5
    [row] = rows(tmp_path, caught.catch_up.metrics)
    assert row["version_withheld"] is True


def test_back_from_a_cut_the_trainer_drops_what_it_held_then_catches_up(tmp_path: Path) -> None:
    caught = catch_up_of(tmp_path, FakeSwarm(epoch=5, ahead=9), [record("b", 9)])
    caught.book.accept(make_group("held", version=5))
    caught.catch_up.peers.connected.set()  # (back in touch already)
    asyncio.run(caught.catch_up.sit_out_isolation())
    assert caught.book.status("held") == "unknown" and not caught.book.queue
    assert caught.catch_up.counts["groups_dropped_isolated"] == 1
    assert caught.catch_up.head.version == 9


# ── Doubtful: batches a peer may have stepped with ────────────────────────────────────


@dataclass
class Settling:
    doubtful: Doubtful
    directory: FakeDirectory
    caught_up: list[int]  # the versions it was at when it caught up


def doubtful_of(tmp_path: Path, version: int, others: list[int]) -> Settling:
    """A trainer at `version` in doubt about batch b/1 (groups g1, g2) of its round at 5;
    the other trainers at `others`, the newest one's state its catch-up's."""
    directory = FakeDirectory()
    peers = peers_of(directory)
    peers.others = {f"t{i}": record(f"t{i}", v) for i, v in enumerate(others)}
    head = Head(version=version, lineage=FORKED)
    caught_up: list[int] = []

    async def catch_up() -> None:
        caught_up.append(head.version)
        head.version = max(others)

    book = GroupBook()
    book.doubtful = [DoubtfulBatch("b/1", 5, [make_group("g1", 5), make_group("g2", 5)], 1e12)]
    doubtful = Doubtful(
        head=head,
        book=book,
        directory=cast(Directory, directory),
        peers=peers,
        catch_up=catch_up,
        metrics=MetricsWriter(tmp_path, "trainer"),
        counts=Counter(),
        batch_ready=asyncio.Event(),
    )
    return Settling(doubtful, directory, caught_up)


def test_a_batch_a_peer_stepped_with_is_trained_in_its_weights_once_caught_up(
    tmp_path: Path,
) -> None:
    settling = doubtful_of(tmp_path, version=5, others=[6])
    settling.directory.marked = {"b/1"}
    doubtful = settling.doubtful
    asyncio.run(doubtful.settle())
    assert settling.caught_up == [5]  # the peer's weights hold the batch: taken first
    assert doubtful.book.doubtful == [] and doubtful.book.undurable == {"g1": 6, "g2": 6}
    assert doubtful.counts["groups_trained_by_peer"] == 2
    [row] = rows(tmp_path, doubtful.metrics)
    assert (row["event"], row["policy_version"], row["lineage"]) == (
        "trained_by_peer",
        6,
        FORKED.id,
    )
    assert row["trained_group_ids"] == ["g1", "g2"]


def test_a_batch_no_peer_took_goes_back_to_the_queue(tmp_path: Path) -> None:
    settling = doubtful_of(tmp_path, version=5, others=[6, 7])  # all past its round, unmarked
    doubtful = settling.doubtful
    asyncio.run(doubtful.settle())
    assert settling.caught_up == []
    assert [g.group_id for g in doubtful.book.queue] == ["g1", "g2"]
    assert doubtful.counts["groups_requeued"] == 2 and doubtful.batch_ready.is_set()


def test_unreadable_marks_leave_the_batch_in_doubt(tmp_path: Path) -> None:
    settling = doubtful_of(tmp_path, version=5, others=[6])
    settling.directory.unreadable = True
    asyncio.run(settling.doubtful.settle())
    assert [b.batch_id for b in settling.doubtful.book.doubtful] == ["b/1"]
    assert not settling.doubtful.book.queue and not settling.doubtful.batch_ready.is_set()


# ── Step: a batch trained, its outcome recorded ───────────────────────────────────────


@dataclass
class Stepping:
    step: Step
    learner: FakeLearner
    versions: FakeVersions
    directory: FakeDirectory
    swarm: FakeSwarm


def step_of(
    tmp_path: Path,
    outcome: StepOutcome,
    rejected: set[str] | None = None,
    checkpoint_every: int = 10,
    withheld: bool = False,
) -> Stepping:
    """The steps of a trainer at version 5 whose every step ends in `outcome`."""
    intake = intake_of(tmp_path)
    config = intake.config
    config.trainer.checkpoint_every = checkpoint_every
    intake.head.lineage = FORKED
    swarm = FakeSwarm(epoch=5, withheld=withheld)
    learner, versions = FakeLearner(outcome, rejected), FakeVersions(intake.head)
    directory = FakeDirectory()
    server = cast(Server, type("NoServer", (), {"rejected": 0, "denied": 0, "refused": {}})())
    step = Step(
        config=config,
        head=intake.head,
        book=intake.book,
        replay=intake.replay,
        filling=intake.filling,
        learner=cast(Learner, learner),
        intake=intake,
        swarm=cast(SwarmOptimizer, swarm),
        directory=cast(Directory, directory),
        versions=cast(Versions, versions),
        publisher=intake.publisher,
        status=status_of(intake, swarm, server),
        metrics=intake.metrics,
        counts=intake.counts,
        device=torch.device("cpu"),
        local_batch=16,
    )
    return Stepping(step, learner, versions, directory, swarm)


def take_step(stepping: Stepping, *groups: str, short: bool = False) -> float:
    batch = [make_group(g, version=4) for g in groups]
    for group in batch:
        stepping.step.book.accept(group)
    stepping.step.book.queue.clear()  # (taken for the step)
    return asyncio.run(stepping.step.run(batch, 0.0, short=short))


def test_an_applied_step_trains_its_groups_and_serves_the_new_version(tmp_path: Path) -> None:
    applied = StepOutcome(epoch=6, applied=True, discarded=False, peer_batches=("p/3",))
    stepping = step_of(tmp_path, applied, rejected={"bad"})
    take_step(stepping, "g1", "g2", "bad")
    step = stepping.step
    assert stepping.learner.calls == [(["g1", "g2", "bad"], 0, [])]  # a full batch: no count
    assert step.head.version == 6 and stepping.versions.published == [6]
    assert step.book.seen == {"g1": "trained", "g2": "trained", "bad": "dropped"}
    assert stepping.directory.marks == [(["g1", "g2"], Mark(FORKED.id, 6), ("p/3",))]
    assert step.counts["groups_trained"] == 2 and step.counts["groups_rejected_logprobs"] == 1
    assert stepping.versions.checkpoints == []  # not due: every 10 versions
    [row] = [r for r in rows(tmp_path, step.metrics) if r.get("event") == "step"]
    assert row["trained_group_ids"] == ["g1", "g2"] and row["policy_version"] == 6
    assert (row["charts/staleness_mean"], row["charts/staleness_max"]) == (1.0, 1)
    assert row["rejected_group_ids"] == ["bad"] and row["counts/groups_trained"] == 2


def test_a_discarded_step_puts_its_groups_back_and_makes_no_version(tmp_path: Path) -> None:
    stepping = step_of(tmp_path, StepOutcome(epoch=5, applied=False, discarded=True))
    take_step(stepping, "g1", "g2", short=True)
    step = stepping.step
    assert stepping.learner.calls[0][1] == 16  # a short batch counts as a full local one
    assert [g.group_id for g in step.book.queue] == ["g1", "g2"]
    assert step.counts["groups_requeued"] == 2 and step.counts["steps_short"] == 1
    assert step.head.version == 5 and stepping.versions.published == []
    assert stepping.directory.marks == []


def test_a_step_failed_on_this_side_only_holds_its_groups_aside(tmp_path: Path) -> None:
    in_doubt = StepOutcome(epoch=5, applied=False, discarded=True, in_doubt="trainer-a/7")
    stepping = step_of(tmp_path, in_doubt)
    take_step(stepping, "g1")
    [batch] = stepping.step.book.doubtful
    assert (batch.batch_id, batch.epoch, [g.group_id for g in batch.groups]) == (
        "trainer-a/7",
        5,
        ["g1"],
    )
    assert stepping.step.counts["groups_in_doubt"] == 1 and not stepping.step.book.queue


def test_a_due_version_is_checkpointed_unless_withheld(tmp_path: Path) -> None:
    applied = StepOutcome(epoch=6, applied=True, discarded=False)
    stepping = step_of(tmp_path / "due", applied, checkpoint_every=2)
    take_step(stepping, "g1")
    assert stepping.versions.checkpoints == [6]
    withheld = step_of(tmp_path / "withheld", applied, checkpoint_every=2, withheld=True)
    take_step(withheld, "g1")
    assert withheld.versions.published == [] and withheld.versions.checkpoints == []
    assert withheld.step.counts["versions_withheld"] == 1
