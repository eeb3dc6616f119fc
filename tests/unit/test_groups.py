"""A trainer's group book (node/groups.py), policy lineages (protocol.Lineage) and how the
DHT's trained marks are read (node/directory.py `durable`, `read_mark`): hand-worked cases,
including a lone trainer killed between checkpoints and resumed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentjet import protocol
from agentjet.protocol import Lineage, fork_id
from node.directory import Mark, durable, read_mark, undecided_mark
from node.groups import Filling, GroupBook, read_trained_log

pytestmark = pytest.mark.unit


def group(group_id: str, version: int = 0, lineage: str = "") -> protocol.TrajectoryGroup:
    sample = protocol.Sample(
        prompt_ids=b"",
        completion_ids=b"",
        logprobs=b"",
        loss_mask=b"",
        reward=0.0,
        advantage=0.0,
        policy_version=version,
    )
    return protocol.TrajectoryGroup(
        group_id=group_id,
        grant_id=group_id,
        node_id="n",
        task_id="t",
        env="arithmetic",
        samples=[sample],
        created_at=0.0,
        lineage=lineage,
    )


# ── lineages ──────────────────────────────────────────────────────────────────────


def test_a_lineage_holds_its_own_versions_up_to_its_newest_and_its_ancestors_up_to_the_fork():
    resumed = Lineage(id="L1").fork(4)
    assert resumed == Lineage(id=fork_id("L1", 4, 0), ancestors={"L1": 4})
    new = resumed.id
    assert resumed.holds(new, 7, newest=7) and not resumed.holds(new, 8, newest=7)
    assert resumed.holds("L1", 4, newest=7)
    assert not resumed.holds("L1", 5, newest=7)  # died with the trainer that made it
    assert not resumed.holds("L9", 0, newest=7)  # an unrelated lineage
    assert resumed.holds("", 0, newest=7) and not resumed.holds("", 1, newest=7)  # base
    assert Lineage().fork(3).holds("", 3, newest=3)  # the root's history up to the fork


def test_a_rollout_node_moves_forward_within_a_lineage_and_never_back_to_a_live_ancestor():
    old = Lineage(id="L1")
    new = old.fork(4)
    live = [new]  # a trainer trains the fork
    assert Lineage(id="L1").supersedes(8, old, 7, [old])
    assert not Lineage(id="L1").supersedes(7, old, 7, [old])
    assert new.supersedes(4, old, 7, live)  # older number, new lineage: the live weights
    assert not old.supersedes(9, new, 5, [old, new])  # back to the lineage it grew from: no
    assert not old.supersedes(9, new, 5, [old, new.fork(6)])  # the fork grew on: no
    assert Lineage(id="L3").supersedes(0, new, 5, live)  # an unrelated one (a fresh start)
    assert Lineage().supersedes(1, Lineage(), 0, [])  # the root, from the base weights


def test_a_rollout_node_leaves_a_lineage_no_live_trainer_continues():
    # A trainer resumed from its checkpoint (fork F of the root) and served F for a moment,
    # then took the swarm's weights, of the root: every live trainer is on the root again.
    root = Lineage()
    fork = root.fork(18)
    assert root.supersedes(21, fork, 18, [root, root])
    assert not root.supersedes(21, fork, 18, [root, fork])  # one still trains the fork


def test_trainers_resuming_from_one_version_open_one_lineage_and_a_second_fork_another():
    parent = Lineage(id="L1")
    nothing_taken = protocol.open_lineage(parent, 6, lambda _: False)
    assert nothing_taken == parent.fork(6) == protocol.open_lineage(parent, 6, lambda _: False)
    used = {parent.fork(6).id}
    again = protocol.open_lineage(parent, 6, used.__contains__)
    assert again == parent.fork(6, counter=1) and again.id != parent.fork(6).id


def test_the_runs_first_start_is_the_root_and_a_fresh_restart_forks_it():
    assert protocol.open_lineage(Lineage(), 0, lambda _: False) == Lineage()
    restarted = protocol.open_lineage(Lineage(), 0, {""}.__contains__)
    assert restarted.id and restarted.ancestors == {"": 0}
    assert Lineage(id="").supersedes(5, Lineage(), 3, [Lineage()])
    assert restarted.supersedes(0, Lineage(), 7, [restarted])  # a node at root v7 moves to it


def test_ancestors_are_bounded():
    lineage = Lineage(id="L0")
    for i in range(1, 3 * protocol.MAX_ANCESTORS):
        lineage = lineage.fork(i)
    assert len(lineage.ancestors) == protocol.MAX_ANCESTORS
    assert lineage.holds(list(lineage.ancestors)[-1], 3 * protocol.MAX_ANCESTORS - 1, 0)


# ── trained marks ─────────────────────────────────────────────────────────────────


def test_a_mark_is_durable_only_while_a_live_trainer_holds_its_step():
    mark = Mark("L1", 6)
    assert durable(mark, [(Lineage(id="L1"), 6)])
    assert durable(mark, [(Lineage(id="L1"), 9)])  # a live peer past it
    assert not durable(mark, [(Lineage(id="L1"), 5)])  # not there yet
    # The lone trainer died at v7, resumed from its checkpoint at v4: v6 is gone.
    assert not durable(mark, [(Lineage(id="L2", ancestors={"L1": 4}), 4)])
    assert not durable(Mark("", 6), [(Lineage(id="L2", ancestors={"": 4}), 9)])
    assert durable(Mark("", 4), [(Lineage(id="L2", ancestors={"": 4}), 9)])
    assert durable(Mark("L1", 4), [(Lineage(id="L2", ancestors={"L1": 4}), 4)])
    assert not durable(mark, [])  # no live trainer: nothing to hold it


def test_a_mark_a_trainer_of_its_lineage_is_behind_is_undecided():
    mark = Mark("", 56)
    assert undecided_mark(mark, [(Lineage(), 54)])  # a stale record, or catching up
    assert not undecided_mark(mark, [(Lineage(), 56)])  # held: durable
    assert not undecided_mark(mark, [(Lineage().fork(54), 60)])  # ruled out: forked at 54
    assert not undecided_mark(mark, [(Lineage().fork(56), 57)])  # held by the fork


@pytest.mark.parametrize(
    "value",
    [None, "trainer-a", ["L1"], ["L1", "6"], [1, 6], ["L1", True], ["x" * 500, 1]],
)
def test_malformed_marks_are_ignored(value: object) -> None:
    found = None if value is None else SimpleNamespace(value=value)
    assert read_mark(found) is None


def test_a_well_formed_mark_reads_back():
    assert read_mark(SimpleNamespace(value=["L1", 6])) == Mark("L1", 6)


# ── the group book ────────────────────────────────────────────────────────────────


def test_a_group_is_told_trained_only_once_a_checkpoint_holds_its_step():
    book = GroupBook()
    a = group("a")
    book.accept(a)
    assert book.status("a") == "queued" and book.known("a")
    batch, stale = book.take(1, version=0, max_policy_lag=2, lineage=Lineage())
    assert batch == [a] and stale == []
    stepped = book.stepped(
        batch, applied=True, discarded=False, in_doubt=None, version=0, deadline=0
    )
    assert stepped.trained == [a]
    book.trained(stepped.trained, version=1)
    assert book.status("a") == "queued"  # in weights a crash would undo
    book.checkpointed(1)
    assert book.status("a") == "trained" and not book.undurable


def test_gradients_kept_for_the_next_epoch_stay_accumulated_until_the_step():
    book = GroupBook()
    a, b = group("a"), group("b")
    kept = book.stepped([a], applied=False, discarded=False, in_doubt=None, version=0, deadline=0)
    assert (kept.trained, kept.requeued, kept.doubtful) == ([], [], None)
    stepped = book.stepped([b], applied=True, discarded=False, in_doubt=None, version=0, deadline=0)
    assert stepped.trained == [a, b]


def test_a_failed_round_puts_every_accumulated_group_back_at_the_queue_front():
    book = GroupBook()
    a, b, c = group("a"), group("b"), group("c")
    book.accept(c)
    book.stepped([a], applied=False, discarded=False, in_doubt=None, version=0, deadline=0)
    out = book.stepped([b], applied=False, discarded=True, in_doubt=None, version=0, deadline=0)
    assert out.requeued == [a, b]
    assert list(book.queue) == [a, b, c] and book.accumulated == []


def test_a_round_failed_on_this_side_only_waits_for_its_mark():
    book = GroupBook()
    a = group("a")
    out = book.stepped([a], applied=False, discarded=True, in_doubt="p/1", version=3, deadline=9)
    assert out.doubtful is not None and out.doubtful.groups == [a]
    assert book.doubtful == [out.doubtful] and not book.queue
    # a peer stepped with it and this trainer holds that version: trained
    trained, again = book.settle({"p/1"}, version=4, others=[4])
    assert trained == [out.doubtful] and again == [] and book.doubtful == []
    # unmarked, and no peer can still take it: trained again (queued)
    out = book.stepped([a], applied=False, discarded=True, in_doubt="p/2", version=4, deadline=9)
    trained, again = book.settle(set(), version=4, others=[5])
    assert again == [out.doubtful] and list(book.queue) == [a]


def test_a_short_batch_stays_queued_and_stale_groups_are_dropped_on_the_way():
    book = GroupBook()
    old, fresh = group("old", version=0), group("fresh", version=5)
    book.accept(old)
    book.accept(fresh)
    batch, stale = book.take(2, version=5, max_policy_lag=2, lineage=Lineage())
    assert batch == [] and stale == [old] and list(book.queue) == [fresh]
    assert book.status("old") == "dropped"


def test_a_step_whose_time_to_fill_passed_takes_the_groups_it_holds():
    book = GroupBook()
    old, fresh = group("old", version=0), group("fresh", version=5)
    book.accept(old)
    book.accept(fresh)
    batch, stale = book.take(4, version=5, max_policy_lag=2, lineage=Lineage(), short=True)
    assert batch == [fresh] and stale == [old] and not book.queue


def test_a_step_fills_when_its_groups_are_queued_before_its_time_to_fill() -> None:
    async def fill() -> bool:
        ready = asyncio.Event()
        filling = Filling(timeout_s=60.0)
        asyncio.get_running_loop().call_soon(ready.set)
        return await filling.wait(ready)

    assert asyncio.run(fill()) is True


def test_a_step_stops_waiting_once_its_time_to_fill_has_passed() -> None:
    async def timed_out() -> tuple[bool, float]:
        filling = Filling(timeout_s=0.05)
        start = asyncio.get_running_loop().time()
        full = await filling.wait(asyncio.Event())  # never set: nothing arrives
        return full, asyncio.get_running_loop().time() - start

    full, waited = asyncio.run(timed_out())
    assert full is False and waited >= 0.04


def test_the_time_to_fill_counts_from_the_last_step_and_zero_means_no_bound() -> None:
    filling = Filling(timeout_s=10.0, since=100.0)
    filling.left_out = 7
    assert filling.remaining_s(104.0) == 6.0 and filling.remaining_s(130.0) == 0.0
    assert "7 left out as zero-variance" in filling.empty_handed(130.0)
    filling.restart(130.0)
    assert filling.remaining_s(131.0) == 9.0 and filling.left_out == 0
    assert Filling(timeout_s=0.0).remaining_s(1e9) is None


def test_cut_off_a_trainer_forgets_what_it_held_so_rollout_nodes_resend_it():
    book = GroupBook()
    a, b, c = group("a"), group("b"), group("c")
    book.accept(a)
    book.stepped([b], applied=False, discarded=False, in_doubt=None, version=0, deadline=0)
    book.stepped([c], applied=False, discarded=True, in_doubt="x/1", version=0, deadline=0)
    assert book.forget_held() == 3
    assert {book.status(g) for g in "abc"} == {"unknown"}


def test_a_trainer_resumed_from_its_checkpoint_knows_the_groups_of_the_steps_it_kept(
    tmp_path: Path,
) -> None:
    """Killed at v7 with a checkpoint at v4: the groups of steps up to v4 are trained (and
    durable), those of v5-v7 unknown, so rollout nodes offer them again. A dead first
    life's step at v2 of the root lineage (killed before any checkpoint; the second life
    forked the root at 0) is not in the resumed weights either."""
    log = tmp_path / "trained_groups.log"
    dead = GroupBook()
    dead.open_log(log, resumed_version=-1)
    dead.trained([group("first-life")], 2, "")
    dead.close_log()
    second = Lineage().fork(0)
    first = GroupBook()
    first.open_log(log, resumed_version=-1, lineage=second)
    for version in range(1, 8):
        first.trained([group(f"g{version}")], version, second.id)
        if version == 4:
            first.checkpointed(4)
    first.close_log()  # the SIGKILL: nothing more is written
    resumed = GroupBook()
    resumed.open_log(log, resumed_version=4, lineage=second.fork(4))
    assert [resumed.status(f"g{v}") for v in range(1, 8)] == ["trained"] * 4 + ["unknown"] * 3
    assert resumed.status("first-life") == "unknown"
    assert resumed.checkpointed_version == 4
    resumed.close_log()


def test_taking_another_lineage_keeps_the_steps_it_holds_and_forgets_the_rest(
    tmp_path: Path,
) -> None:
    """In lineage X, checkpointed at v2, stepped v3 and v5; the swarm's weights are v4 of a
    fork of X at v3: the v3 step is in them (trained, durable once a checkpoint here holds
    it), the v5 step is in no weights that go on (unknown: offered again)."""
    log = tmp_path / "trained_groups.log"
    own = Lineage().fork(0)
    book = GroupBook()
    book.open_log(log, resumed_version=-1, lineage=own)
    book.trained([group("kept")], 2, own.id)
    book.checkpointed(2)
    book.trained([group("held")], 3, own.id)
    book.trained([group("lost")], 5, own.id)
    assert book.adopt(read_trained_log(log), own.fork(3), 4) == 1
    assert [book.status(g) for g in ("kept", "held", "lost")] == ["trained", "queued", "unknown"]
    book.checkpointed(4)
    assert book.status("held") == "trained" and not book.undurable
    book.close_log()


def test_a_trainer_that_takes_a_peers_weights_knows_the_groups_its_last_life_stepped_in_them(
    tmp_path: Path,
) -> None:
    """The fault suite's "kill both trainers": trainer A checkpointed at v52 and stepped v53
    and v54 with its peer; B checkpointed v54. Both killed, B resumes (a fork at v54) and A,
    its checkpoint older, takes B's weights. A's v53-v54 groups are in them: A must not say
    "unknown" (they were sent again and trained twice) but "queued" until its own
    checkpoint holds them; its v55 step died with it."""
    log = tmp_path / "trained_groups.log"
    first = GroupBook()
    first.open_log(log, resumed_version=-1)
    for version in (52, 53, 54, 55):
        first.trained([group(f"g{version}")], version, "")
        if version == 52:
            first.checkpointed(52)
    first.close_log()  # the SIGKILL
    taken = Lineage().fork(54)
    again = GroupBook()
    again.open_log(log, resumed_version=-1, lineage=taken)
    assert again.adopt(read_trained_log(log), taken, 54) == 0
    statuses = [again.status(f"g{v}") for v in (52, 53, 54, 55)]
    assert statuses == ["queued", "queued", "queued", "unknown"]
    again.checkpointed(56)
    assert [again.status(f"g{v}") for v in (52, 53, 54)] == ["trained"] * 3
    again.close_log()


def test_a_group_trained_in_two_lives_is_kept_if_the_weights_taken_hold_either_step(
    tmp_path: Path,
) -> None:
    """Life 1 trained g at v10 of the root and died before a checkpoint; life 2 resumed
    from v8 (lineage Y), g came again and was trained at Y's v12, and h came again and
    waits in the queue. The swarm's weights taken now hold the root's v10 but not Y's v12:
    g and h are in them (queued until a checkpoint here, whatever the log's order), and h
    leaves the queue rather than be trained twice."""
    log = tmp_path / "trained_groups.log"
    first = GroupBook()
    first.open_log(log, resumed_version=-1)
    first.trained([group("g"), group("h")], 10, "")
    first.close_log()
    y = Lineage().fork(8)
    second = GroupBook()
    second.open_log(log, resumed_version=8, lineage=y)
    second.trained([group("g")], 12, y.id)
    second.accept(group("h"))  # life 1 trained it too; sent again, queued here
    assert second.adopt(read_trained_log(log), Lineage().fork(10), 11) == 0
    assert second.status("g") == "queued" and second.undurable == {"g": 10, "h": 10}
    assert not second.queue  # h is in the weights taken: not trained again
    second.close_log()


def test_a_trained_log_with_torn_or_foreign_lines_reads_its_steps(tmp_path: Path) -> None:
    log = tmp_path / "trained_groups.log"
    assert read_trained_log(log) == []
    log.write_text("3\tg1\tL\n4\tg2\nnot-a-version\tg3\n5\t\n6\tg4\tL")  # torn last line
    assert read_trained_log(log) == [(3, "g1", "L"), (4, "g2", ""), (6, "g4", "L")]


def test_groups_sampled_by_a_lineage_these_weights_do_not_descend_from_are_dropped():
    """Resumed at v4 of L1 (lineage L2): L1's samples up to v4 train, later ones died with
    the old trainer; samples of L2 train at any version (a peer may be ahead)."""
    resumed = Lineage(id="L1").fork(4)
    book = GroupBook()
    kept, dead, ahead = (
        group("kept", 4, "L1"),
        group("dead", 6, "L1"),
        group("ahead", 7, resumed.id),
    )
    for g in (kept, dead, ahead):
        book.accept(g)
    batch, stale = book.take(2, version=5, max_policy_lag=8, lineage=resumed)
    assert batch == [kept, ahead] and stale == [dead]
    assert book.status("dead") == "dropped"
    assert resumed.trains("", 0) and not resumed.trains("", 1) and not resumed.trains("L9", 0)
