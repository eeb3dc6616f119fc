"""A lone trainer SIGKILLed between checkpoints and started again with the same command,
as a user would run it (`agentjet keys init`, `coordinator`, `node --role trainer`, `node
--role rollout`): nothing trained is lost, the policy never goes back within a lineage, no
group sampled by the dead lineage past its checkpoint is trained, nothing the dead trainer
started outlives it, and the restarted trainer dials nothing of its previous life.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentjet.lifeline import descendants, running
from agentjet.metrics import read_metrics
from tests import procs
from tests.integration.test_swarm import REPO_ROOT, Swarm, free_listen, swarm_factory

pytestmark = pytest.mark.integration

__all__ = ["swarm_factory"]  # the fixture, used by name

CHECKPOINT_EVERY = 4
ORPHAN_WAIT_S = 10.0


def keys_init(path: Path) -> None:
    """The README's first command."""
    done = procs.run(
        [sys.executable, "-m", "agentjet_app.cli", "keys", "init", "--out", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def rows(swarm: Swarm, name: str, role: str, event: str) -> list[dict[str, Any]]:
    return [r for r in swarm.metrics(name, role) if r.get("event") == event]


def between_checkpoints(version: int) -> bool:
    """Past a checkpoint and before the next: any such version, not only the first, which
    the tiny model can step past between two polls (it makes several versions a second)."""
    return version > CHECKPOINT_EVERY and version % CHECKPOINT_EVERY != 0


def alive_after(pids: set[int], wait_s: float) -> set[int]:
    """The processes of `pids` still running `wait_s` after now (polled, bounded)."""
    deadline = time.monotonic() + wait_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {p for p in pids if running(p)}


def test_a_lone_trainer_killed_between_checkpoints_resumes_and_loses_nothing(
    swarm_factory: Callable[..., Swarm], tmp_path: Path
) -> None:
    swarm = swarm_factory(f"trainer.checkpoint_every={CHECKPOINT_EVERY}")
    keys_init(tmp_path / "readme.keys")
    swarm.keys_file = tmp_path / "readme.keys"
    swarm.start("coordinator", "coordinator", "--listen", free_listen())
    join = swarm.join_address()
    trainer_args = (
        "node",
        "--role",
        "trainer",
        "--join",
        join,
        "--listen",
        free_listen(),
        "--identity",
        str(tmp_path / "trainer.identity"),
    )
    swarm.start("trainer", *trainer_args)
    swarm.start("rollout", "node", "--role", "rollout", "--join", join)

    swarm.wait_for(
        "a version past a checkpoint, before the next",
        lambda: between_checkpoints(swarm.version("trainer")),
    )
    first = swarm.procs["trainer"]
    children = descendants(first.pid)
    swarm.spawned |= children
    assert children, "the trainer runs hivemind's processes"
    os.kill(first.pid, signal.SIGKILL)  # the main process alone, not its group
    first.wait()
    killed_at = swarm.version("trainer")
    # 4: nothing the dead trainer started outlives it.
    orphans = alive_after(children, ORPHAN_WAIT_S)
    assert not orphans, {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in orphans}
    first_life = rows(swarm, "trainer", "trainer", "step")
    started = rows(swarm, "trainer", "trainer", "started")
    old_lineage = started[-1]["lineage"]
    (swarm.dir / "trainer.log").rename(swarm.dir / "trainer-first-life.log")

    swarm.start("trainer", *trainer_args)  # the same command
    swarm.wait_for(
        "the restarted trainer's first steps",
        lambda: (
            len(rows(swarm, "trainer", "trainer", "started")) == 2
            and swarm.version("trainer") >= killed_at + 2
        ),
    )
    restarted = rows(swarm, "trainer", "trainer", "started")[-1]
    new_lineage = restarted["lineage"]
    assert new_lineage != old_lineage
    resumed = restarted["policy_version"]
    assert resumed == killed_at - killed_at % CHECKPOINT_EVERY  # its newest checkpoint
    assert restarted["lineage_ancestors"] == {old_lineage: resumed}

    def moved() -> bool:
        loads = rows(swarm, "rollout", "rollout", "weights_loaded")
        return any(r["lineage"] == new_lineage for r in loads)

    swarm.wait_for("the rollout node on the new lineage", moved)
    codes = swarm.stop()
    assert set(codes.values()) <= {0}, swarm.logs()

    # 2: the rollout node's versions never went back within a lineage.
    loads = rows(swarm, "rollout", "rollout", "weights_loaded")
    newest: dict[str, int] = {}
    for load in loads:
        assert load["policy_version"] > newest.get(load["lineage"], -1), loads
        newest[load["lineage"]] = load["policy_version"]
    # ... and no group the dead lineage sampled past the checkpoint was trained.
    sampled = {
        g: (b["lineage"], b["policy_version"])
        for b in rows(swarm, "rollout", "rollout", "batch")
        for g in b["group_ids"]
    }
    second_life = [r for r in swarm.steps("trainer") if r.get("lineage") == new_lineage]
    trained_again = {g for r in second_life for g in r["trained_group_ids"]}
    crossed = {g for g in trained_again if sampled[g][0] == old_lineage and sampled[g][1] > resumed}
    assert not crossed

    # 1: every group the rollout node let go as trained is in the resumed weights.
    trained_durably = {
        g for r in first_life if r["policy_version"] <= resumed for g in r["trained_group_ids"]
    }
    let_go = {
        g for r in rows(swarm, "rollout", "rollout", "trainer_gone") for g in r["trained_group_ids"]
    }
    assert let_go <= trained_durably
    lost_steps = {
        g for r in first_life if r["policy_version"] > resumed for g in r["trained_group_ids"]
    }
    assert lost_steps, "the kill came after steps no checkpoint held"
    # Those groups were offered again: trained in the new lineage, dropped (their lineage
    # died), or still held by the rollout node.
    stale = {g for r in rows(swarm, "trainer", "trainer", "stale") for g in r["stale_group_ids"]}
    held = set(rows(swarm, "rollout", "rollout", "stopped")[-1]["unacked_group_ids"])
    assert lost_steps <= trained_again | stale | held
    assert not (lost_steps & let_go)

    # 3: the restarted trainer dialed nothing of its previous life; no tracebacks.
    log = (swarm.dir / "trainer.log").read_text()
    assert "dial to self" not in log
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize(
    "processes",
    [(("planner",), ("solver",)), (("planner", "solver"),)],
    ids=["a trainer process per policy", "one trainer process serving both"],
)
def test_a_policys_trainer_killed_mid_run_loses_nothing_of_either_policy(
    processes: tuple[tuple[str, ...], ...],
    swarm_factory: Callable[..., Swarm],
    tmp_path: Path,
) -> None:
    """[[policies]] (issue 26): the trainer process serving the planner is SIGKILLed
    between the planner's checkpoints and started again with the same command. A solver
    trained by another process trains on meanwhile; one trained by the killed process
    resumes too. The rollout node, which finds each policy's trainer in the directory
    (NODE/POLICY for a process serving both), moves to each restarted policy's new
    lineage; each policy's groups are trained by its own trainer, once in the weights that
    go on, dropped as stale or still held: nothing of either policy is lost. The agent
    calls both policies in each episode, so the planner's grants make solver groups too."""
    swarm = swarm_factory(
        f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
        'envs.0.agent="tests.agents:planner_and_solver"',
        'envs.1.name="arithmetic"',
        "envs.1.difficulties=[1]",
        'policies.0.name="planner"',
        'policies.0.envs=["agent"]',
        "policies.0.lora_rank=2",
        'policies.1.name="solver"',
        'policies.1.envs=["arithmetic"]',
        "policies.1.lora_rank=2",
    )
    swarm.start("coordinator", "coordinator", "--listen", free_listen())
    join = swarm.join_address()
    process_of = {policy: "-".join(served) for served in processes for policy in served}
    args = {
        "-".join(served): ("node", "--role", "trainer", "--policy", ",".join(served),
                           "--join", join, "--listen", free_listen(),
                           "--identity", str(tmp_path / f"{'-'.join(served)}.identity"))
        for served in processes
    }  # fmt: skip
    for name in args:
        swarm.start(name, *args[name])
    swarm.start("rollout", "node", "--role", "rollout", "--join", join)

    def policy_rows(policy: str, event: str) -> list[dict[str, Any]]:
        path = swarm.dir / process_of[policy] / "policies" / policy / "metrics" / "trainer.jsonl"
        found = read_metrics(path) if path.exists() else []
        return [r for r in found if r.get("event") == event]

    def version(policy: str) -> int:
        return max((r["policy_version"] for r in policy_rows(policy, "step")), default=0)

    swarm.wait_for(
        "the planner past a checkpoint, before the next, and the solver stepping",
        lambda: between_checkpoints(version("planner")) and version("solver") >= 1,
    )
    killed = process_of["planner"]
    restarting = [p for p, name in process_of.items() if name == killed]
    process = swarm.procs[killed]
    swarm.spawned |= descendants(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = {p: version(p) for p in process_of}
    first_life = {p: policy_rows(p, "step") for p in restarting}
    old_lineage = {p: policy_rows(p, "started")[-1]["lineage"] for p in restarting}
    (swarm.dir / f"{killed}.log").rename(swarm.dir / f"{killed}-first-life.log")
    swarm.start(killed, *args[killed])  # the same command

    def moved(policy: str) -> bool:
        started = policy_rows(policy, "started")
        if len(started) < 2 or version(policy) < killed_at[policy] + 2:
            return False
        new = started[-1]["lineage"]
        loads = rows(swarm, "rollout", "rollout", "weights_loaded")
        return any(r["policy"] == policy and r["lineage"] == new for r in loads)

    for policy in restarting:
        swarm.wait_for(
            f"the restarted {policy}'s steps, loaded by the rollout node",
            lambda policy=policy: moved(policy),  # type: ignore[misc]
        )
    swarm.wait_for("the solver training on", lambda: version("solver") >= killed_at["solver"] + 2)
    codes = swarm.stop()
    assert set(codes.values()) <= {0}, swarm.logs()

    batches = rows(swarm, "rollout", "rollout", "batch")
    policy_of = {g: p for b in batches for g, p in b["group_policies"].items()}
    held = set(rows(swarm, "rollout", "rollout", "stopped")[-1]["unacked_group_ids"])
    durable: set[str] = set()
    for policy in ("planner", "solver"):
        steps = policy_rows(policy, "step")
        if policy in restarting:  # the weights that go on: up to the checkpoint, then anew
            restarted = policy_rows(policy, "started")[-1]
            resumed, new_lineage = restarted["policy_version"], restarted["lineage"]
            assert new_lineage != old_lineage[policy]
            assert resumed == killed_at[policy] - killed_at[policy] % CHECKPOINT_EVERY
            kept = [r for r in first_life[policy] if r["policy_version"] <= resumed]
            durable |= {g for r in kept for g in r["trained_group_ids"]}
            steps = kept + [r for r in steps if r.get("lineage") == new_lineage]
        trained = [g for r in steps for g in r["trained_group_ids"]]
        assert len(trained) == len(set(trained)), f"a {policy} group was trained twice"
        assert {policy_of[g] for g in trained} == {policy}  # by its own policy's trainer
        stale = {g for r in policy_rows(policy, "stale") for g in r["stale_group_ids"]}
        queued = set(policy_rows(policy, "stopped")[-1]["queued_group_ids"])
        made = {g for g, p in policy_of.items() if p == policy}
        assert made - set(trained) - stale - held - queued == set(), f"{policy} lost groups"
    let_go = {
        g for r in rows(swarm, "rollout", "rollout", "trainer_gone") for g in r["trained_group_ids"]
    }
    assert let_go <= durable  # what the rollout node let go as trained, a checkpoint holds
    assert any(p == "solver" and g.endswith("-solver") for g, p in policy_of.items())
