"""`SwarmOptimizer`: the trainers' optimizer over the swarm (hivemind underneath, in
node/optimizer.py and node/averagers.py; the DHT in node/dht.py, the directory in
node/directory.py).

    learner grads ──step_outcome(samples)──▶ wait for the other live trainers' batches
        (node/rendezvous.py) ──▶ one exact gradient round (node/allreduce.py: every
        trainer gets the same averaged bits) ──▶ AdamW ──▶ the epoch (= policy version)
        advances; a lone trainer steps at once. Every `swarm.average_state_every`
        versions a parameter round re-synchronises a trainer that missed a step.

Local mode uses this exact path with a single peer, so the swarm code is always exercised.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import hivemind
import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)

from agentjet.bridge import blocking
from agentjet.config import SwarmConfig
from node.averagers import (
    ROUND_PARTS,
    ExactGradientAverager,
    round_averaged,
    round_failed,
    round_incomplete,
)
from node.dht import start_dht
from node.directory import Directory
from node.learner import set_lr
from node.local_steps import outer_optimizer
from node.members import MemberGate
from node.optimizer import HivemindOptimizer, RoundFailed
from node.rendezvous import Rendezvous
from node.rounds import RoundTrouble, StepOutcome

log = logging.getLogger(__name__)

# swarm.grad_compression's values: how a round's tensors travel (node/allreduce.py).
COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "uint8": Uniform8BitQuantization,
    "quantile8": Quantile8BitQuantization,
}

# How long a step waits for hivemind's tracker to read the peers it saw (a DHT read; seconds
# on a busy box).
TRACKER_REFRESH_S = 5.0


async def attach_when_peered(swarm: SwarmOptimizer, period_s: float) -> None:
    """A trainer's loop: start hivemind's averagers (made with `attach_at_start=False`)
    once another trainer of its run is about, looked for every `period_s`; then idle, as
    a role's loops do until the role stops. (A step starts them too, if it finds a peer
    first.)"""
    while not swarm.attached:
        if await blocking(swarm.peered):
            await blocking(swarm.attach)
        else:
            await asyncio.sleep(period_s)
    await asyncio.Event().wait()


def _hivemind_optimizer(
    config: SwarmConfig,
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    target_batch_size: int,
    dht: hivemind.DHT,
    other_trainers: Callable[[], int],
    gate: MemberGate | None,
    attach_at_start: bool,
) -> HivemindOptimizer:
    """hivemind.Optimizer as a trainer runs it over `dht` (`SwarmOptimizer`'s arguments)."""
    compression = COMPRESSIONS[config.grad_compression]()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # see start_dht
    try:
        return HivemindOptimizer(
            other_trainers=other_trainers,
            gate=gate,
            attach_at_start=attach_at_start,
            dht=dht,
            run_id=config.run_id,
            target_batch_size=target_batch_size,
            optimizer=outer_optimizer(config, lr, weight_decay),
            params=params,
            matchmaking_time=config.matchmaking_time_s,
            averaging_timeout=config.averaging_timeout_s,
            average_state_every=config.average_state_every,
            # Average parameters inside the step, not in the background after it: the
            # version a step makes is then the averaged one. With exact rounds the
            # trainers' gradients, and so their steps, are already bit-identical; the
            # parameter round re-synchronizes one that missed a step. Adam's moments
            # are not averaged: fed the same averaged gradients they stay identical,
            # and averaging them would triple the bytes.
            delay_state_averaging=False,
            grad_compression=compression,
            averager_opts={"request_timeout": config.request_timeout_s},
            # How long a round waits for a peer's next part of the tensors (hivemind's
            # default, one matchmaking time, failed half the rounds on a busy box: "50%
            # of the average gradient never came", a peer's averager not scheduled
            # for a second).
            next_chunk_timeout=config.averaging_timeout_s / ROUND_PARTS,
            # A whole state download: two of its chunks' timeouts (`WholeStateAverager`).
            # hivemind's default, 600 s, held a joiner whose download stalled for ten
            # minutes; given up, it asks again (`load_state_from_peers`).
            load_state_timeout=4 * (config.matchmaking_time_s + config.averaging_timeout_s),
            # A dead trainer stops counting as a peer within record_ttl_s (hivemind's
            # default, 60 s, would fail every round with it for a minute).
            tracker_opts={"metadata_expiration": config.record_ttl_s},
            grad_averager_factory=partial(
                ExactGradientAverager,
                request_timeout=config.request_timeout_s,
                gate=gate,
                attach_at_start=attach_at_start,
            ),
            # hivemind offloads the optimizer by default, and then averages parameters in
            # place: the averager's process writes each averaged part straight into the
            # optimizer's parameters as it arrives, even after a step stopped waiting for
            # the round, so nothing could keep a broken round's parts out of a version
            # (`WholeStateAverager` copies only a whole average). Not offloaded, a round
            # averages copies. The optimizer then steps where the model is.
            offload_optimizer=False,
            verbose=False,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


class SwarmOptimizer:
    def __init__(
        self,
        config: SwarmConfig,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        target_batch_size: int,
        dht: hivemind.DHT | None = None,
        other_trainers: Callable[[], int] = lambda: 0,
        gate: MemberGate | None = None,
        directory: Directory | None = None,
        attach_at_start: bool = True,
    ) -> None:
        """Train over `dht` (shared with the node's `directory`, which signs the batches'
        intents with the node's keys), or a DHT of its own. `other_trainers()`: how many
        other live trainers the directory lists now. `gate`: who may call this trainer's
        averaging handlers (None: anyone, without keys). `attach_at_start=False`: start
        hivemind's averager processes only once a peer appears (`peered`, `attach`)."""
        self.gate = gate
        self.config = config
        self.other_trainers = other_trainers
        self.owns_dht = dht is None
        self.dht = dht or start_dht(config, keys=None)  # in-process use (tests, bench)
        self.directory = directory or Directory(self.dht, config)
        # Versions re-taken from a peer after this trainer's parameter round failed.
        self.repairs = 0
        # What this trainer says when its rounds keep failing (node/rounds.py).
        self.trouble = RoundTrouble()
        try:
            self.optimizer = _hivemind_optimizer(
                config,
                params,
                lr=lr,
                weight_decay=weight_decay,
                target_batch_size=target_batch_size,
                dht=self.dht,
                other_trainers=other_trainers,
                gate=gate,
                attach_at_start=attach_at_start,
            )
        except BaseException:
            if self.owns_dht:
                self.dht.shutdown()
            raise
        # Held for each whole step, and while a state is served from the weights.
        self.step_lock = self.optimizer.step_lock
        # The wait for the other trainers' batches before each round (node/rendezvous.py).
        self.rendezvous = Rendezvous(
            self.optimizer, self.dht, other_trainers, floor_s=config.averaging_timeout_s
        )

    @property
    def epoch(self) -> int:
        """The swarm's optimizer epoch: the policy version of the current weights."""
        return int(self.optimizer.local_epoch)

    # The learner trains the weights the model holds: the version's.
    training = staticmethod(contextlib.nullcontext)

    @property
    def state_loads(self) -> int:
        """How often this trainer took (or tried to take) a peer's state."""
        return int(self.optimizer.reloads)

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """Name in the DHT (in the background) the groups whose gradients the next
        `step_outcome` adds, or that add none but are trained with them; returns the id of
        the batch that holds them. Call it before that step."""
        with self.optimizer.step_lock:
            batch_id = str(self.optimizer.grad_averager.batch_id)
            named, stores = self.optimizer.intents
            if named != batch_id:
                stores = []
            stores += self.directory.name_batch(batch_id, group_ids)
            self.optimizer.intents = (batch_id, stores)
            return batch_id

    @property
    def attached(self) -> bool:
        """Whether hivemind's averager processes run: from the start (`attach_at_start`),
        or since this trainer first had a peer."""
        return self.optimizer.attached

    def peered(self) -> bool:
        """Whether another trainer of this run is about (so this one must serve its state
        and join rounds): the directory lists one, hivemind's progress tracker counts one,
        or a peer's state averager is declared in the DHT, as a joining trainer's is before
        it asks for state (a DHT read)."""
        if self._peer_in_view():
            return True
        key = f"{self.optimizer.state_averager.prefix}.all_averagers"
        found = self.dht.get(key, latest=True)
        declared = found.value if found is not None else None
        own = self.dht.peer_id.to_bytes()
        return isinstance(declared, dict) and any(
            peer != own and isinstance(getattr(info, "value", None), (int, float))
            for peer, info in declared.items()
        )

    def _peer_in_view(self) -> bool:
        """`peered` without its DHT read: what the directory and the tracker show now."""
        return self.other_trainers() > 0 or self.optimizer.tracker.global_progress.num_peers > 1

    def attach(self) -> None:
        """Start hivemind's averager processes, if they are not running: between steps."""
        with self.optimizer.step_lock:
            self.optimizer.attach()

    def stop(self) -> None:
        """The trainer stops: a step waiting for peers, a round or a state download gives
        it up now (its gradients are not applied, so its groups are not trained)."""
        self.optimizer.stopping.set()

    @property
    def round_problem(self) -> str:
        """Why this trainer's gradient rounds keep failing ("" while they work)."""
        return self.trouble.problem

    def step_outcome(self, batch_size: int, lr: float | None = None) -> StepOutcome:
        """Hand the accumulated `.grad`s of `batch_size` samples to the swarm (the step
        at `lr`); whether they were applied, kept or thrown away, and the epoch after."""
        self.rendezvous.pace.step_began()
        if self.attached and self.other_trainers() > 0 and not self.rendezvous.meet(batch_size):
            # stopping: the batch was given up
            return StepOutcome(self.epoch, applied=False, discarded=True, withheld=self.withheld)
        with self.optimizer.step_lock:
            if not self.attached and self._peer_in_view():
                self.optimizer.attach()
            # hivemind's tracker reads the swarm's progress every few seconds: have it count
            # the peers whose batches were just seen, or it would step alone.
            if self.other_trainers() > 0:
                self.optimizer._refresh_progress(timeout=TRACKER_REFRESH_S)
            epoch, discards = self.epoch, self.optimizer.discards
            if self.optimizer.tracker.global_epoch > epoch:
                # hivemind would step a peer one epoch behind on its own older weights
                # (and reconcile later); take the swarm's state first instead.
                self.optimizer.load_state_from_peers()
                self.optimizer.zero_grad()
                return StepOutcome(
                    self.epoch, applied=False, discarded=True, withheld=self.withheld
                )
            averager = self.optimizer.state_averager
            unapplied = averager.unapplied
            rounds = [self.optimizer.scheduled_state]
            averager.rounds = ()
            self.optimizer.peer_batches = ()
            batch_id, in_doubt = str(self.optimizer.grad_averager.batch_id), None
            # hivemind's `param_groups` are copies: set its torch optimizer's.
            set_lr(self.optimizer.state_averager.optimizer, lr)
            try:
                self.optimizer.step(batch_size=batch_size)
            except RoundFailed as e:
                if self.optimizer.stopping.is_set():
                    log.info("stopping: the step's gradient round is given up")
                else:
                    log.info("gradient round with peers failed (%s); its gradients are dropped", e)
                    warning = self.trouble.failed(str(e))
                    if warning is not None:
                        log.warning(warning)
                self.optimizer.discard_round()
                in_doubt = batch_id if e.sent else None
            self.optimizer.zero_grad()
            rounds += averager.rounds
            self.optimizer.incomplete_rounds += sum(round_incomplete(r) for r in rounds)
            if self.epoch > epoch and (
                any(round_failed(r) for r in rounds)
                or self._unaveraged(rounds, epoch)
                or averager.unapplied > unapplied
            ):
                # The gradients were averaged, but the parameters were not (or not all of
                # them): hivemind keeps this trainer's own result, which can differ from
                # the others' at this version (by 6e-4 on a fresh clone: a parameter round
                # still running when hivemind stopped waiting for it). A peer whose round
                # succeeded has the version's averaged state: take it (the step counts).
                log.info(
                    "parameter averaging failed at version %d; taking a peer's state", self.epoch
                )
                self.repairs += 1
                self.optimizer.take_swarm_state()
                if not averager.downloaded:
                    # No peer sent its state: this version may be a weight set of this
                    # trainer's own. The caller withholds it (no checkpoint, not published)
                    # until a later step or download brings the swarm's.
                    self.optimizer.hold_own(True)
            elif self.epoch > epoch:  # a new version, the swarm's
                self.optimizer.hold_own(False)
        discarded = self.optimizer.discards > discards
        applied = not discarded and self.epoch > epoch
        if applied and self.optimizer.peer_batches:
            self.trouble.succeeded()
        return StepOutcome(
            self.epoch,
            applied=applied,
            discarded=discarded,
            peer_batches=self.optimizer.peer_batches if applied else (),
            in_doubt=in_doubt,
            withheld=self.withheld,
        )

    def _unaveraged(self, rounds: list[Any], epoch: int) -> bool:
        """Whether a step from `epoch` taken with peers (its gradient round vouched for
        their batches) was due a parameter round that did not end with the average here:
        one that failed, or that hivemind stopped waiting for while it still ran."""
        due = self.epoch % self.optimizer.average_state_every == 0
        with_peers = bool(self.optimizer.peer_batches)
        return (
            self.epoch > epoch and with_peers and due and not any(round_averaged(r) for r in rounds)
        )

    def counts(self) -> dict[str, int]:
        """How often rounds went wrong and how the trainer recovered, for metrics."""
        optimizer = self.optimizer
        return {
            "failed_rounds": optimizer.failed_rounds,
            "incomplete_rounds": optimizer.incomplete_rounds,
            "partial_rounds": optimizer.partial_rounds,
            "late_intents": optimizer.late_intents,
            "state_downloads": optimizer.reloads,
            "repairs": self.repairs,
            "waits_for_peers": self.rendezvous.waits,
            **(self.gate.counts() if self.gate is not None else {}),
        }

    def refusals(self) -> dict[str, int]:
        """Non-members' averaging calls refused so far, per kind (none without a gate)."""
        return self.gate.refusals() if self.gate is not None else {}

    @property
    def withheld(self) -> bool:
        """Whether the current version's weights may be this trainer's own, not the
        swarm's: not to checkpoint or publish (`StepOutcome.withheld`)."""
        return self.optimizer.own.is_set()

    def load_state_from_peers(
        self, wait_s: float = 0.0, while_true: Callable[[], bool] = lambda: False
    ) -> bool:
        """Take the swarm's current weights, optimizer state and epoch (a joining trainer);
        False if no peer sent its state. It can be a version a peer withholds (`withheld`).
        If none did, ask again every heartbeat for up to `wait_s` while `while_true()` (a
        live trainer is listed: a lone one starts serving once it sees this one,
        `attach_at_start`)."""
        deadline = time.monotonic() + wait_s
        with self.optimizer.step_lock:
            self.optimizer.load_state_from_peers()
            asked = False
            while (
                not self.optimizer.state_averager.downloaded
                and time.monotonic() < deadline
                and not self.optimizer.stopping.is_set()
                and while_true()
            ):
                if not asked:
                    log.info(
                        "no trainer has sent its state yet; asking again for up to %.0f s", wait_s
                    )
                    asked = True
                time.sleep(min(self.config.heartbeat_s, max(0.0, deadline - time.monotonic())))
                self.optimizer.take_swarm_state()
            return bool(self.optimizer.state_averager.downloaded)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state (AdamW moments), for a checkpoint to resume from."""
        with self.optimizer.step_lock:
            return copy.deepcopy(self.optimizer.state_averager.optimizer.state_dict())

    def restore(self, epoch: int, optimizer_state: dict[str, Any]) -> None:
        """Resume from a checkpoint: its optimizer state, and its version as the epoch (the
        parameters were loaded into the model before this optimizer was made)."""
        with self.optimizer.step_lock:
            self.optimizer.state_averager.optimizer.load_state_dict(optimizer_state)
            self.optimizer.set_epoch(epoch)

    def processes(self) -> dict[str, Any]:
        """The hivemind processes this optimizer works through, by a name for people: its
        DHT and its two averagers (multiprocessing.Process each, children of this process;
        for `agentjet.lifeline.watch_children`: a step would wait forever on a dead one)."""
        found = {
            "hivemind DHT": self.dht,
            "hivemind gradient averager": self.optimizer.grad_averager,
            "hivemind state averager": self.optimizer.state_averager,
        }
        return {name: process for name, process in found.items() if process is not None}

    def shutdown(self) -> None:
        """Optimizer first (says goodbye, stops averagers), then a DHT of its own."""
        for averager in (self.optimizer.grad_averager, self.optimizer.state_averager):
            if averager is not None and (averager.exitcode is not None or not averager.attached):
                # It died (the role stops for that: `processes`), or never started. hivemind
                # would log either as an error, a death with the traceback of the error the
                # role stops on.
                averager.shutdown = lambda: None
        try:
            self.optimizer.shutdown()
        finally:
            if self.owns_dht:
                self.dht.shutdown()
