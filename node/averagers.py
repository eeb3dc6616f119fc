"""hivemind's averagers and progress tracker as the trainers need them: rounds that leave
every trainer the same bits, handlers that answer members only, a gradient batch id, state
served whole and under the step lock. Every class here overrides hivemind internals and was
checked against hivemind 1.1.12 (the methods each one touches are named in its docstring);
a hivemind upgrade starts by reading them again.

    MembersOnly ─────────────┬─▶ ExactGradientAverager  (gradient rounds; node/allreduce.py)
    AveragerWatch ───────────┴─▶ WholeStateAverager     (parameter rounds, state downloads)
    Tracker                                              (hivemind's ProgressTracker)

node/optimizer.py's `HivemindOptimizer` makes them; `round_*` read a finished round
(hivemind's StepControl) for the trainer's step.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import signal
import threading
import typing
import uuid
from collections.abc import Callable
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from node import memory
from node.allreduce import ExactAverager, RoundResult, incomplete
from node.directory import is_batch_id
from node.members import MemberGate
from node.rounds import RoundAbandoned, result_unless_stopping

log = logging.getLogger(__name__)

# A round's patience for a peer's next part of the tensors is the averaging timeout over
# this (matchmaking, the reduce and the gather each take their part).
ROUND_PARTS = 3
# How long an averager's process may take to start serving (`MembersOnly.attach`).
ATTACH_TIMEOUT_S = 60.0


def round_data(value: object) -> tuple[str | None, int | None]:
    """What a peer sent as its all-gather data in a gradient round: (its batch id, its
    epoch); None for a part that is not one."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None, None
    batch_id, epoch = value
    return (
        batch_id if is_batch_id(batch_id) else None,
        epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
    )


def vouched_batches(result: RoundResult) -> tuple[str, ...]:
    """The batch ids of a gradient round's peers whose whole gradients are in this peer's
    result."""
    batches = (round_data(d)[0] for peer, d in result.items() if peer in result.contributors)
    return tuple(sorted(b for b in batches if b is not None))


def round_epochs(result: RoundResult) -> set[int | None]:
    """The epochs the peers of a gradient round said they were at (None: not said)."""
    return {round_data(d)[1] for d in result.values()}


class MembersOnly(DecentralizedAverager):  # type: ignore[misc]
    """hivemind's averaging handlers, answered for members only (`MemberGate`; None: no
    gate, for net.insecure and in-process tests). Checked against hivemind 1.1.12's
    DecentralizedAverager.rpc_join_group, rpc_aggregate_part and rpc_download_state: a
    non-member's join is turned away as if this peer looked for no group, its all-reduce
    stream gets a protocol violation before any part is read, and its state download ends
    empty, as a peer that does not share state answers. (hivemind reads the handlers'
    stream types from `typing.AsyncIterator` hints only: ServicerBase._strip_iterator_hint.)"""

    attached = False  # its process was started (`start`)

    def __init__(
        self,
        *args: Any,
        gate: MemberGate | None = None,
        attach_at_start: bool = True,
        start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.gate = gate
        super().__init__(*args, start=start and attach_at_start, **kwargs)

    def start(self) -> None:
        """Fork the averager's process without the trainer's own tensors (node/memory.py):
        it works on copies in shared memory. Checked against hivemind 1.1.12, where
        DecentralizedAverager is an `mp.Process` started from its constructor (unless
        `attach_at_start` is False: then by `attach`)."""
        with memory.left_behind():
            super().start()
        self.attached = True

    def attach(self, timeout_s: float) -> None:
        """Start the averager's process, if it is not running yet, and wait until it
        serves: it then declares this peer's state for download and joins rounds. Any
        thread may call it: hivemind's `run_in_background` sets a signal handler, which
        only the main thread can (the process ignores SIGINT itself: `run`)."""
        if not self.attached:
            self.start()
            self.wait_until_ready(timeout_s)

    def run(self) -> None:
        """The averager's process: Ctrl-C is for the trainer, which shuts it down. (hivemind
        ignores SIGINT in the parent around the fork instead, which only works from the main
        thread; the process keeps the trainer's handler otherwise.)"""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        super().run()

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._share_with_priority(value)

    def _share_with_priority(self, value: float) -> None:
        """hivemind's setter, which asks the averager's process to declare it again; before
        the process runs it is only kept, and declared when it starts (each message would
        wait in the pipe meanwhile, and a full pipe blocks the trainer)."""
        if self.attached:
            DecentralizedAverager.state_sharing_priority.fset(self, value)
        else:
            self._state_sharing_priority.value = value

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.gate is not None and not await self.gate.admits(context, "round_joins"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        if self.gate is not None and not await self.gate.admits(context, "aggregate_parts"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        if self.gate is not None and not await self.gate.admits(context, "state_downloads"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message


class ExactGradientAverager(MembersOnly, GradientAverager, ExactAverager):  # type: ignore[misc]
    """hivemind's gradient averager, with rounds that leave every trainer the same bits,
    and a batch id for the gradients it accumulates: new at each reset (a step took them,
    or they were thrown away), unique to this process (a restarted trainer, same peer id,
    must not reuse one a peer may have marked). Each gradient round carries it, and the
    trainer's epoch, as its all-gather data (`round_data`). A round is scheduled while the
    gradients accumulate, and every reset comes with the scheduled round triggered,
    cancelled or joined with weight zero.

    Its buffers cost memory only when used (`memory.shared_zeros`, `untouched_zeros`):
    2 x the parameters' size that hivemind writes from the start. The first batch after a
    reset stays in `.grad` (`in_grad`): hivemind would add it to zeroed accumulators, so
    they would hold exactly `.grad`. It is copied into them only if a second batch comes
    before the reset (an epoch of several `step` calls) or `.grad` is cleared meanwhile
    (`materialize`, called by `HivemindOptimizer.zero_grad`), and into the averaged gradients only
    for a round. A trainer whose every step is an epoch never writes the accumulators; a
    lone one never writes the averaged gradients either. For an optimizer not offloaded
    (SwarmOptimizer's). Checked against hivemind 1.1.12's GradientAverager
    (accumulate_grads_, load_accumulators_into_averager_, reset_accumulated_grads_, step)
    and Optimizer (_update_global_epoch, _load_local_gradients_into_optimizer)."""

    # The batch's gradients are still in `.grad`, not copied into the accumulators: one
    # batch since the last reset, so the accumulators would hold them exactly (`in_grad`).
    in_grad = False
    _accumulated = False  # the accumulators were written since they were last zeroed
    _in_round = False  # inside `step`: hivemind loads the gradients into a round

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The rounds' timeout, in memory the averager's process (forked later) shares.
        self._round_timeout_s = multiprocessing.RawValue(ctypes.c_double, 0.0)
        self.process_tag = uuid.uuid4().hex[:12]
        self.batches = 0
        self.epoch: Callable[[], int] = lambda: 0  # the optimizer's, set by HivemindOptimizer
        params = kwargs["parameters"] = tuple(kwargs["parameters"])
        kwargs.setdefault("averaged_grads", tuple(memory.shared_zeros(p) for p in params))
        super().__init__(*args, **kwargs)
        accumulators: tuple[torch.Tensor, ...] | None = self._local_accumulators  # type: ignore[has-type]
        if accumulators is not None and all(a.device.type == "cpu" for a in accumulators):
            self._local_accumulators = memory.untouched_zeros(accumulators)

    @property
    def batch_id(self) -> str:
        return f"{self.process_tag}/{self.batches}"

    def accumulate_grads_(self, batch_size: int) -> None:
        if self.local_times_accumulated == 0 and not self.reuse_grad_buffers:  # type: ignore[has-type]
            # hivemind's bookkeeping, the add into zeroed accumulators left out
            self._anchor_batch_size = batch_size
            self.local_samples_accumulated = batch_size
            self.local_times_accumulated = 1
            self.in_grad = True
            return
        self.materialize()
        self._accumulated = True
        super().accumulate_grads_(batch_size)

    def materialize(self) -> None:
        """Copy gradients left in `.grad` into the accumulators, before `.grad` changes."""
        if self.in_grad:
            for grad, accumulator in zip(
                self._grads_from_parameters(), self._grad_accumulators(), strict=True
            ):
                accumulator.copy_(grad)
            self.in_grad, self._accumulated = False, True

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """For a round, the batch's gradients into the averaged ones. Without one, into
        `.grad`, where the optimizer (not offloaded) steps: hivemind loads them into the
        averaged gradients then too, and reads those nowhere after (1.1.12: a lone epoch of
        several `step` calls stepped on the last call's gradients alone)."""
        if self._in_round and not self.in_grad:
            super().load_accumulators_into_averager_()
        elif self._in_round:
            with self.get_tensors() as averaged:
                for grad, out in zip(self._grads_from_parameters(), averaged, strict=True):
                    out.copy_(grad)
        elif not self.in_grad:
            scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
            for grad, accumulator in zip(
                self._grads_from_parameters(), self._grad_accumulators(), strict=True
            ):
                grad.copy_(accumulator).mul_(scale)

    def reset_accumulated_grads_(self) -> None:
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None  # type: ignore[assignment]
        if self._accumulated:  # (zeroing untouched pages would make them exist)
            for accumulator in self._grad_accumulators():
                accumulator.zero_()
        self.in_grad = self._accumulated = False
        self.batches += 1

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_round = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._in_round = False

    @property
    def _allreduce_timeout(self) -> float | None:
        """How long a round's all-reduce may take (hivemind 1.1.12 reads it in the
        averager's process, `_step`), from memory shared with that process: the trainer
        sets it between rounds (`set_round_timeout`)."""
        return self._round_timeout_s.value or None

    @_allreduce_timeout.setter
    def _allreduce_timeout(self, value: float | None) -> None:
        self._round_timeout_s.value = value or 0.0

    @property
    def allreduce_kwargs(self) -> dict[str, Any]:
        """hivemind's per-round settings, each part of a round given a third of its
        timeout (hivemind's sender_timeout; reducer_timeout twice that, its default)."""
        timeout_s = self._round_timeout_s.value
        if not timeout_s:
            return self._allreduce_kwargs
        part_s = timeout_s / ROUND_PARTS
        return {**self._allreduce_kwargs, "sender_timeout": part_s, "reducer_timeout": 2 * part_s}

    @allreduce_kwargs.setter
    def allreduce_kwargs(self, value: dict[str, Any]) -> None:
        self._allreduce_kwargs = value

    def set_round_timeout(self, timeout_s: float) -> None:
        """From the next round on, its all-reduce may take `timeout_s`."""
        self._allreduce_timeout = timeout_s

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> Any:
        if kwargs.get("gather") is None:
            kwargs["gather"] = [self.batch_id, int(self.epoch())]
        return super().schedule_step(scheduled_time, **kwargs)


class AveragerWatch(ExactAverager):
    """Records what hivemind's TrainingStateAverager only logs: the controls of the
    averaging rounds it begins (`rounds`; a failed parameter round leaves this peer with
    its own parameters) and whether its last state download got a state to load
    (`downloaded`), and a withheld one (`downloaded_own`).

    It sits between TrainingStateAverager and DecentralizedAverager in the bases of
    `WholeStateAverager`, so TrainingStateAverager's calls to its base pass through here
    (and its parameter rounds are exact, as ExactAverager makes them).
    """

    rounds: tuple[Any, ...] = ()
    downloaded = False
    # The state downloaded was a withheld version: its server's own weights, not the swarm's.
    downloaded_own = False
    # The round a parameter step waits on (hivemind passes one scheduled ahead to `_do`,
    # or begins one there).
    last_round: Any = None
    stopping = threading.Event()  # the trainer's (`HivemindOptimizer.stopping`), set at its stop

    def step(self, *args: Any, **kwargs: Any) -> Any:
        control = super().step(*args, **kwargs)
        if not kwargs.get("wait", True):
            self.rounds = (*self.rounds[-3:], control)
            self.last_round = control
        return control

    def load_state_from_peers(self, timeout: float | None = None) -> Any:
        """hivemind's download, waited for in short turns: a stop gives it up (the state
        averager's `stopping`, set when the trainer stops; RoundAbandoned)."""
        future = super().load_state_from_peers(wait=False, timeout=timeout)
        try:
            state = result_unless_stopping(future, timeout, self.stopping)
        except RoundAbandoned:
            future.cancel()
            raise
        metadata = state[0] if state is not None else {}
        # TrainingStateAverager loads it next, unless the peer's epoch is behind this one's.
        epoch = metadata.get("epoch")
        self.downloaded = isinstance(epoch, int) and epoch >= self.local_epoch
        self.downloaded_own = self.downloaded and metadata.get("withheld") is True
        return state


class WholeStateAverager(MembersOnly, TrainingStateAverager, AveragerWatch):  # type: ignore[misc]
    """Serves this trainer's state copied under the lock each step holds: one version.

    A peer therefore answers a state download only between its steps, and a step lasts
    up to one averaging timeout. hivemind gives each chunk of a download `next_chunk_timeout`
    (one matchmaking time, also its all-reduce patience): a joiner asking a busy trainer
    would nearly always time out. Downloads wait `state_chunk_timeout_s` instead.

    While this trainer is itself downloading state it refuses to serve (two trainers
    downloading from each other would each wait for the other's lock).

    While its version is withheld (`own`: a parameter round failed and no peer sent the
    version's state, so its weights are its own) it serves the state marked `withheld`,
    and ranks it below any other at its epoch (`state_sharing_priority`). A peer takes
    it only when nobody serves better, and then withholds it too: unmarked, such weights
    would pass for the swarm's version, and a peer repairing from them would checkpoint
    them while another held the version's average. Refused instead, they left a swarm
    whose every trainer was withheld with nobody to download from (CI: three trainers
    stuck at one version for minutes). Taken, the trainers hold one weight set, and
    their next step together makes a version that is the swarm's.

    A parameter round averages copies of the parameters (the optimizer is not offloaded:
    `SwarmOptimizer`), which hivemind copies back after the round, even when it stopped
    waiting for the round (its timeout) while the round still runs and writes averaged
    parts into them: the parameters would be a mix of this trainer's own and averaged
    parts, a weight set no other trainer has (seen on a fresh 2-core clone: 6e-4 apart at
    one version). Here only a whole average is copied; otherwise the parameters stay this
    trainer's own and `unapplied` counts it, for `SwarmOptimizer` to take a peer's state
    for that version. Checked against hivemind 1.1.12's TrainingStateAverager._do, step
    and _apply_averaging_results_.
    """

    unapplied = 0

    def __init__(
        self,
        *args: Any,
        step_lock: threading.Lock,
        loading: threading.Event,
        own: threading.Event,
        stopping: threading.Event,
        state_chunk_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        self.stopping = stopping
        self._step_lock = step_lock
        self._loading = loading
        self._own = own
        self._state_chunk_timeout_s = state_chunk_timeout_s
        super().__init__(*args, **kwargs)

    def _make_averaged_parameters(self, main_parameters: Any) -> tuple[torch.Tensor, ...]:
        """The buffers of a parameter round: hivemind fills them with a copy of the
        parameters here, though it copies the parameters in again before each round
        (`_load_local_tensors_into_averager_`) and reads them nowhere else (1.1.12). Zeros
        in untouched shared memory instead: 513 MB for SmolLM2-135M that a trainer without
        peers never pays (node/memory.py)."""
        if self.offload_optimizer or self.reuse_tensors:  # (they are the optimizer's own)
            return super()._make_averaged_parameters(main_parameters)  # type: ignore[no-any-return]
        return tuple(
            memory.shared_zeros(p).requires_grad_(p.requires_grad) for p in main_parameters
        )

    def _do(
        self,
        wait_for_trigger: Any,
        optimizer_step: bool,
        zero_grad: bool,
        averaging_round: bool,
        averaging_control: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        self.last_round = averaging_control  # replaced by `step` if hivemind begins another
        return super()._do(
            wait_for_trigger,
            optimizer_step,
            zero_grad,
            averaging_round,
            averaging_control,
            *args,
            **kwargs,
        )

    def _apply_averaging_results_(self) -> None:
        if not round_whole(self.last_round):
            self.unapplied += 1
            log.info("a parameter round had not ended whole: this trainer keeps its own step")
            return
        # Each peer joins a parameter round with the epoch of the state it averages
        # (hivemind gathers it). A trainer that finished its step late can join its
        # peers' round for the next epoch: all would then hold one mix of two versions,
        # which it names the earlier one and they the later (seen on this 2-core box:
        # trainer-b's v8 was trainer-a's v9, bit for bit). Such a round is not applied.
        epochs = set(self.last_round.result().values())
        if epochs != {self.local_epoch}:
            self.unapplied += 1
            log.info(
                "a parameter round mixed peers at epochs %s, this trainer at %d: it keeps "
                "its own step",
                sorted(map(str, epochs)),
                self.local_epoch,
            )
            return
        super()._apply_averaging_results_()

    async def _load_state_from_peers(self, future: Any, timeout: float | None = None) -> None:
        # Runs in the averager's process, never during its own all-reduce (a download runs
        # under the step lock, and so does every round), so the swap is seen by this alone.
        all_reduce_timeout: Any = self.next_chunk_timeout  # type: ignore[has-type]
        self.next_chunk_timeout = self._state_chunk_timeout_s
        try:
            await super()._load_state_from_peers(future, timeout)
        finally:
            self.next_chunk_timeout = all_reduce_timeout

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        # Peers download from the highest first (hivemind sets the epoch after each step).
        ranked = value - 0.5 if self._own.is_set() else value
        self._share_with_priority(ranked)

    def get_current_state(self) -> Any:
        if self._loading.is_set():
            raise RuntimeError("this trainer is loading the swarm's state itself")
        with self._step_lock:
            metadata, tensors, infos = super().get_current_state()
            metadata["withheld"] = self._own.is_set()
            return metadata, [t.clone() for t in tensors], infos


class Tracker(ProgressTracker):  # type: ignore[misc]
    """hivemind's progress tracker, with its event loop left clean when it stops.

    hivemind 1.1.12's `ProgressTracker._progress_fetcher` returns at shutdown without
    cancelling a DHT read still in flight (and `run` never closes its loop), so a trainer
    that stopped while its tracker was reading ended with asyncio's "Task was destroyed but
    it is pending!" at ERROR when the loop was collected (test_durable, in CI). Same `run`,
    then what is left on the loop is cancelled and awaited, and the loop closed.
    """

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                asyncio.gather(self._progress_reporter(), self._progress_fetcher())
            )
        finally:
            try:
                leftovers = asyncio.all_tasks(loop)
                for task in leftovers:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            finally:
                loop.close()
                self.shutdown_complete.set()


def round_ended(control: Any) -> bool:
    return control is not None and control.done() and not control.cancelled()


def round_incomplete(control: Any) -> bool:
    """Whether a hivemind averaging round (StepControl) left this peer without part of the
    average, though hivemind calls it a success (node/allreduce.py `RoundResult.missing`)."""
    return round_ended(control) and control.exception() is None and incomplete(control.result())


def round_whole(control: Any) -> bool:
    """Whether a round (StepControl) has ended, without error, with the whole average."""
    if not round_ended(control) or control.exception() is not None:
        return False
    result = control.result()
    return not isinstance(result, RoundResult) or not (incomplete(result) or result.partial)


def round_averaged(control: Any) -> bool:
    """Whether a parameter round ended with this peer holding the whole average of its own
    and at least one other peer's parameters."""
    if not round_whole(control):
        return False
    result = control.result()
    return bool(result.contributors) if isinstance(result, RoundResult) else bool(result)


def round_failed(control: Any) -> bool:
    """Whether a hivemind averaging round ended in an error, or incomplete."""
    if not round_ended(control):
        return False
    return control.exception() is not None or incomplete(control.result())
