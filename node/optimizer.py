"""`HivemindOptimizer`: hivemind.Optimizer as the trainers run it. A failed gradient round
aborts the step (`RoundFailed`) rather than step on this trainer's own gradients, a stop
gives up a round or a state download (`RoundAbandoned`), and a round's timeouts follow the
rounds' measured times (node/rounds.py `RoundTimeout`). Checked against hivemind 1.1.12's
Optimizer; node/swarm.py's `SwarmOptimizer` is its one user.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.timed_storage import get_dht_time

from node.allreduce import RoundResult, incomplete
from node.averagers import (
    ATTACH_TIMEOUT_S,
    Tracker,
    WholeStateAverager,
    round_epochs,
    vouched_batches,
)
from node.members import MemberGate
from node.rounds import RoundAbandoned, RoundTimeout, result_unless_stopping

log = logging.getLogger(__name__)

# A trainer about to average its gradients waits at most this long for the intents naming
# their groups to be stored (they usually are, long before); then it goes on without.
INTENT_WAIT_S = 1.0


class HivemindOptimizer(hivemind.Optimizer):  # type: ignore[misc]
    """hivemind.Optimizer that counts discarded gradients and serves whole versions.

    A peer that finds itself out of sync inside `step()` loads the swarm's state and
    throws away the gradients it had accumulated; so does a step whose gradient round
    failed. The samples behind them were not trained, and the caller must know to train
    them again: `discards` counts both.

    hivemind serves its state to a joining peer from a background thread, reading the
    parameters while a step may be changing them in place (on CPU `.cpu()` is not a copy),
    so the joiner could get weights of no version at all. Here the state is copied under
    `step_lock`, which `SwarmOptimizer` holds for the whole of each step.
    """

    discards = 0
    reloads = 0  # state downloads: the part of `discards` that cost the whole state in bytes
    failed_rounds = 0
    # Rounds hivemind called a success though a reducer failed this peer (RoundResult.missing):
    # gradient rounds count as failed rounds too, parameter rounds as repairs.
    incomplete_rounds = 0
    # Gradient rounds in which a reducer left a sender out midway (RoundResult.partial).
    partial_rounds = 0
    # Gradient rounds entered before the intents naming the batch's groups were stored.
    late_intents = 0
    averaging_timeout: float  # hivemind's; how long a round may take (`_apply_round_timeout`)

    def __init__(
        self,
        *args: Any,
        other_trainers: Callable[[], int],
        gate: MemberGate | None = None,
        attach_at_start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.gate = gate  # read by _make_state_averager, which hivemind calls in __init__
        self.attach_at_start = attach_at_start  # likewise
        self.step_lock = threading.Lock()  # held by SwarmOptimizer for each whole step
        self.loading = threading.Event()  # set while this trainer downloads the swarm's state
        # Set while this trainer's version is withheld (`StepOutcome.withheld`): the
        # weights are its own, not the swarm's, and peers take them as such. (`hold_own`)
        self.own = threading.Event()
        self._other_trainers = other_trainers
        # A batch id, and the stores of the intents naming that batch's groups.
        self.intents: tuple[str, list[Any]] = ("", [])
        # Peers' batches the last gradient round vouches for (`vouched_batches`).
        self.peer_batches: tuple[str, ...] = ()
        # Set when the trainer stops: a step waiting on a round or a state download gives
        # it up (`RoundAbandoned`) rather than keep the stop waiting.
        self.stopping = threading.Event()
        # How long a gradient round may take, sized from the rounds that succeeded.
        self.round_timeout = RoundTimeout(floor_s=kwargs["averaging_timeout"])
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # hivemind 1.1.12 starts the progress tracker's thread before it makes the
            # averagers: one that fails (a bad prefix, a port) left that thread running, and
            # the trainer's process hung at exit instead of ending with its error.
            tracker = getattr(self, "tracker", None)
            if tracker is not None:
                tracker.shutdown()
            raise
        self.grad_averager.epoch = lambda: self.local_epoch

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        """hivemind 1.1.12's own, as `Tracker` (a loop left clean at shutdown)."""
        return Tracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        # hivemind binds the serving method at construction: the subclass must be built here.
        return WholeStateAverager(
            gate=self.gate,
            step_lock=self.step_lock,
            loading=self.loading,
            own=self.own,
            stopping=self.stopping,
            # A peer answers a state download between steps; a step takes up to a
            # matchmaking time and an averaging timeout for each of its two rounds.
            state_chunk_timeout_s=2 * (self.matchmaking_time + self.averaging_timeout),
            attach_at_start=self.attach_at_start,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    @property
    def attached(self) -> bool:
        """Whether both averagers' processes run (`attach`)."""
        return bool(self.state_averager.attached and self.grad_averager.attached)

    def attach(self) -> None:
        """Start the averagers' processes if they are not running (made with
        `attach_at_start=False`): a trainer alone has no rounds to join and nobody to serve
        its state to, and each process costs 100-200 MB. Call it between steps."""
        if not self.attached:
            log.info("starting hivemind's averagers: another trainer of this run is about")
            for averager in (self.state_averager, self.grad_averager):
                averager.attach(ATTACH_TIMEOUT_S)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """hivemind calls this inside `step()` when out of sync: the gradients are lost."""
        self.take_swarm_state(**kwargs)
        self.discards += 1

    def _download_state_once(self, **kwargs: Any) -> None:
        """hivemind 1.1.12's `Optimizer.load_state_from_peers`, with one attempt.

        Its loop asks again at once after any error, `BaseException` included, so a Ctrl-C
        while joining (the `SystemExit` a role raises during set-up) was logged as "Failed
        to load state from peers ... retrying" and swallowed, and a timeout was retried
        forever with a traceback each time. Here an error is one line and no state
        (`state_averager.downloaded` stays False: callers ask again, bounded), and a stop
        propagates. The rest is hivemind's (a scheduled gradient round is joined with
        weight zero, the state averager's pending work is waited for, the tracker's epoch
        and the accumulators are reset after), but for the gradient averager's "state":
        hivemind downloads a peer's averaged gradients too, then drops them unread (another
        model's size in bytes and memory on both sides)."""
        scheduled: Any = self.scheduled_grads  # type: ignore[has-type]
        if scheduled is not None and not scheduled.done():
            self._tag_along_with_zero_weight(scheduled)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except Exception as e:  # a timeout, a peer gone: no state this time
                log.info("could not download the swarm's state: %r", e)
                return
            global_epoch = self.tracker.global_epoch
            if global_epoch - 1 <= self.local_epoch < global_epoch:
                self.state_averager.local_epoch = global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            self.state_averager.state_sharing_priority = self.local_epoch
            self.grad_averager.reset_accumulated_grads_()
            self.grad_averager.state_sharing_priority = self.local_epoch

    def take_swarm_state(self, **kwargs: Any) -> None:
        """Download the state of the newest peer, serving none meanwhile."""
        self.attach()
        epoch = self.local_epoch
        self.state_averager.downloaded = False
        self.loading.set()
        try:
            self._download_state_once(**kwargs)
        finally:
            self.loading.clear()
        self.reloads += 1
        if self.state_averager.downloaded:
            # The swarm's state, or a peer's withheld version: then withheld here too.
            self.hold_own(self.state_averager.downloaded_own)
        elif self.local_epoch != epoch:
            # hivemind moves a peer one epoch behind to the swarm's epoch even when no
            # peer sent its state: its old weights would be named the new version (seen:
            # 7e-4 apart from the other trainer's at that version). Stay behind instead;
            # the next step tries again.
            log.info("no peer sent its state; staying at version %d", epoch)
            self.set_epoch(epoch)

    def hold_own(self, own: bool) -> None:
        """Say whether this trainer's weights are its own (its version withheld) or the
        swarm's, and rank its state for peers' downloads by it."""
        if own:
            self.own.set()
        else:
            self.own.clear()
        self.state_averager.state_sharing_priority = self.local_epoch

    def set_epoch(self, epoch: int) -> None:
        """Name this trainer's current state `epoch`, to its averagers and the swarm."""
        self.state_averager.local_epoch = epoch
        self.state_averager.state_sharing_priority = epoch
        self.grad_averager.state_sharing_priority = epoch
        self.tracker.report_local_progress(epoch, samples_accumulated=0)
        # Else the tracker keeps its old view for seconds, and steps wait for it.
        self._refresh_progress(timeout=self.matchmaking_time)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """hivemind's, after gradients it counts as accumulated but left in `.grad` are
        copied out (an epoch not ended by this step: `ExactGradientAverager.in_grad`)."""
        self.grad_averager.materialize()
        super().zero_grad(set_to_none=set_to_none)

    def _load_local_gradients_into_optimizer(self) -> None:
        """A round that did not happen: step on this trainer's own gradients, which
        `ExactGradientAverager` loads into `.grad` (the optimizer is not offloaded)."""
        assert not self.offload_optimizer
        self.grad_averager.load_accumulators_into_averager_()
        self.grad_averager.notify_used_averaged_gradients()

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind starts matchmaking for the next gradient round ahead of the step, and
        cancels it at the step when its tracker sees no other peer. A round cancelled in
        matchmaking can leave the averager's matchmaking broken for good: seen in a swarm
        test, a trainer that had just joined (its tracker not yet showing the other)
        cancelled one; its averager's matchmaking tasks were destroyed while pending, and
        every round of both trainers after that found no group, for minutes. And a round
        already matched runs on though cancelled (`_begin_averaging_gradients`). Schedule
        only with a peer to meet (a lone trainer, local mode included, has nothing to
        match)."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        """hivemind's tracker may not know of a peer yet (it refreshes every few seconds)
        and step alone; the swarm's directory is fresher. With other trainers listed there,
        a step without a round is a failed round.

        Before its gradients go in, the batch's intents must be stored, or a peer could
        vouch for a batch nobody can find the groups of: wait for them, a little."""
        batch_id, stores = self.intents
        if batch_id == self.grad_averager.batch_id and self.tracker.global_progress.num_peers > 1:
            deadline = time.monotonic() + INTENT_WAIT_S
            try:
                stored = [f.result(max(0.0, deadline - time.monotonic())) for f in stores]
            except Exception as e:  # a timeout, or a DHT error
                stored = [repr(e)]
            if not all(s is True for s in stored):
                self.late_intents += 1
                log.info("averaging gradients before the batch's groups are named in the DHT")
        scheduled = self.scheduled_grads
        began = bool(super()._begin_averaging_gradients(grad_scaler))
        others = self._other_trainers()
        if not began and others:
            self.failed_rounds += 1
            # hivemind cancels a round it had scheduled when its tracker sees no other peer,
            # but a round already matched runs on in the averager, this trainer's gradients
            # in it (seen: a peer stepped with them, then the averager found its control
            # cancelled). With one scheduled, a peer may have them.
            raise RoundFailed(
                f"no gradient round formed, but {others} other trainers are live",
                sent=scheduled is not None,
            )
        return began

    def _average_gradients_and_load_into_optimizer(self, control: Any) -> None:
        """hivemind steps with this peer's own gradients when a round with peers fails;
        two peers doing so at once make one epoch name two different weight sets. Here a
        failed round aborts the step instead (RoundFailed): the caller drops the gradients
        (`discard_round`), and their samples are trained again."""
        if control is not None:
            try:
                result = self._wait_for_round(control)
            except BaseException as e:
                # No group found: nothing was sent. Else the round broke on this side, or
                # this trainer gave up waiting for it (it may go on: a round past
                # matchmaking cannot be called off).
                self.failed_rounds += not isinstance(e, RoundAbandoned)
                sent = bool(control.began_allreduce) or not control.done()
                raise RoundFailed(repr(e), sent=sent) from None
            if incomplete(result):
                # A reducer failed this peer: part of its "average" is its own gradients.
                # The peers may have got all of this peer's gradients and stepped.
                self.incomplete_rounds += 1
                self.failed_rounds += 1
                raise RoundFailed(
                    f"{result.missing:.1%} of the average gradient never came", sent=True
                )
            if isinstance(result, RoundResult):
                if result.partial:
                    # A reducer left a sender out from where it stopped: every peer that
                    # got the whole average sees it, and none steps on it.
                    self.partial_rounds += 1
                    self.failed_rounds += 1
                    raise RoundFailed("a peer's gradients are in part of the average only")
                epochs = round_epochs(result)
                if epochs != {self.local_epoch}:
                    # A trainer behind whose tracker had not yet seen the swarm move on:
                    # each would step its own weights and name them its own next version
                    # (seen in bench-identity: one trainer's v1-v3 were the other's v2-v4).
                    self.failed_rounds += 1
                    raise RoundFailed(
                        f"peers at epochs {sorted(map(str, epochs))} in one gradient round, "
                        f"this trainer at {self.local_epoch}"
                    )
                self.peer_batches = vouched_batches(result)
        super()._average_gradients_and_load_into_optimizer(control)

    def _wait_for_round(self, control: Any) -> Any:
        """The round's result, waited for up to the averaging timeout, and for a round in
        its all-reduce then, up to the all-reduce's own timeout more (its averager gives it
        that); a stop gives it up at once (`result_unless_stopping`). A timeout says where
        the round stalled. Both timeouts follow the rounds' measured times (`RoundTimeout`)."""
        began = time.monotonic()
        try:
            try:
                result = result_unless_stopping(control, self.averaging_timeout, self.stopping)
            except TimeoutError:
                if control.done() or not control.began_allreduce:
                    raise
                result = result_unless_stopping(control, self.allreduce_timeout, self.stopping)
        except TimeoutError:
            if control.done():  # the round's own error
                raise
            self.round_timeout.timed_out()
            self._apply_round_timeout()
            stage = control.stage.name.lower().replace("_", " ")
            raise TimeoutError(
                f"no round within {time.monotonic() - began:.0f} s, still {stage}"
            ) from None
        self.round_timeout.succeeded(time.monotonic() - began)
        self._apply_round_timeout()
        return result

    def _apply_round_timeout(self) -> None:
        """Rounds from the next on may take `round_timeout.s` (changes under a tenth are
        left out: each is logged)."""
        timeout_s = self.round_timeout.s
        if abs(timeout_s - self.averaging_timeout) >= 0.1 * self.averaging_timeout:
            log.info("gradient rounds may now take %.0f s", timeout_s)
            self.averaging_timeout = self.allreduce_timeout = timeout_s
            self.grad_averager.set_round_timeout(timeout_s)

    def discard_round(self) -> None:
        """After RoundFailed: forget the round and the gradients; the weights are untouched.

        No state is loaded here. A trainer whose round failed because the other is busy
        loading *its* state would otherwise load in turn, both holding their step locks
        while asking each other for state: neither answers, and it repeats every step
        (seen in CI after a cut link healed). A trainer behind the swarm finds out from
        hivemind's tracker or the directory and catches up at its next step."""
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and not control.done():
                control.cancel()
            setattr(self, name, None)
        self.grad_averager.reset_accumulated_grads_()
        self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        self._publish_progress()
        self.discards += 1
        self._refresh_progress(timeout=self.matchmaking_time)

    def _publish_progress(self) -> None:
        """Store this trainer's progress in the DHT now, as hivemind's reporter would.

        That reporter (1.1.12 `ProgressTracker._progress_reporter`, on the tracker's thread)
        publishes a peer's progress only once it has read it with samples > 0. A round
        that fails at once (no peer seen yet) reports 0 samples again before that thread
        runs, and then it never publishes: no tracker counts this trainer, so no round ever
        forms (seen: two trainers in lock step failing a round every 60 ms for minutes).
        The store is waited for (bounded), so the refresh that follows counts this trainer."""
        tracker = self.tracker
        stored = self.dht.store(
            key=tracker.training_progress_key,
            subkey=tracker._local_public_key,
            value=tracker.local_progress.dict(),
            expiration_time=get_dht_time() + tracker.metadata_expiration,
            return_future=True,
        )
        with contextlib.suppress(Exception):  # a timeout or a DHT error: the reporter's turn
            stored.result(timeout=self.matchmaking_time)

    def _refresh_progress(self, timeout: float) -> None:
        """Have hivemind's tracker read the swarm's progress now and wait for it. It reads
        every few seconds; a trainer retrying at once, as a failed round makes it do,
        would find the same stale view (one peer: no round) every time."""
        tracker = self.tracker
        tracker.fetched_global_progress_this_epoch.clear()
        tracker.global_progress.next_fetch_time = 0.0  # wakes the fetcher to read at once
        tracker.global_state_updated.set()
        tracker.fetched_global_progress_this_epoch.wait(timeout)


class RoundFailed(Exception):
    """A gradient all-reduce with other trainers failed; the step did not happen here.

    `sent`: the round failed on this side only, as far as this trainer can tell (it gave
    up waiting, or a reducer failed it), so a peer may have stepped with all of its
    gradients. Whether one did is in the DHT: that peer marks the batch trained
    (`Directory.marked_batches`). Otherwise no peer stepped with them: no round formed,
    or every peer of it sees what failed it (peers at two epochs, a partial average)."""

    def __init__(self, reason: str, sent: bool = False) -> None:
        super().__init__(reason)
        self.sent = sent
