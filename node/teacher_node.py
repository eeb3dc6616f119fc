"""The teacher role: a node that scores rollout nodes' samples with teacher models, for
on-policy distillation where the rollout nodes have no room for the teachers.

    rollout node ──TeacherScoreRequest (CURVE)──▶ Server ──checked──▶ waiting (at most
                                                  MAX_WAITING; more: Error "busy")
    scorer task:  one request at a time ──(bridge)──▶ Teacher.logprobs: a prefill of each
                  sample ──▶ TeacherScores ──▶ the rollout node
    heartbeat:    NodeRecord (role "teacher": endpoint, teachers, waiting, samples/s)
                  ──▶ the swarm's DHT directory, where rollout nodes find it

Run with `agentjet node --role teacher --join MULTIADDR [--teacher NAME ...]`: the teachers
named (default: every `envs[].teacher` of the config), each loaded once, on `rollout.device`
with `rollout.torch_threads`, in the model's dtype; each must share the model's tokenizer
(`model.name`), as rollout nodes' token ids are its input. A request names its teacher as
the environments' config does. The node keeps no state of its own: killed and started
again, it serves again, and rollout nodes hold their groups meanwhile (node/teacher.py).

Every request is checked before it reaches a model (a teacher served here, a temperature
> 0, a top k of 0 to protocol.MAX_TOP_K, tokens within the vocabulary, at most MAX_SAMPLES
samples of at most MAX_SEQUENCE_TOKENS tokens): a bad one gets one Error and is counted,
and the node serves on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import Config
from agentjet.devices import resolve_device
from agentjet.identity import node_keys
from agentjet.logs import RepeatedLog
from agentjet.metrics import MetricsWriter, Rate
from agentjet.roles import run_role, supervise
from agentjet.transport import Server
from node.dht import start_dht, visible_maddrs
from node.directory import Directory
from node.gpu_monitor import GpuMonitor
from node.model import load_tokenizer, resolve_model
from node.teacher import Teacher, load_teachers

log = logging.getLogger(__name__)

# Requests waiting to be scored; past this a request is answered "busy".
MAX_WAITING = 64
# Samples in one request, and tokens in one sample (prompt + completion), at most.
MAX_SAMPLES = 1024
MAX_SEQUENCE_TOKENS = 8192
# Temperatures a request may name (the sampler's; > 0).
MAX_TEMPERATURE = 100.0
# The node's samples/s (its directory record) is over this many seconds.
SAMPLE_RATE_WINDOW_S = 60.0

Waiting = tuple[list[bytes], protocol.TeacherScoreRequest, Teacher]


class TeacherNode:
    def __init__(self, config: Config, names: list[str]) -> None:
        self.config = config
        self.names = names
        self.node_id = f"teacher-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.counts: Counter[str] = Counter()
        self.sample_rate = Rate(SAMPLE_RATE_WINDOW_S)
        self.samples_per_s = 0.0
        self.scoring = 0  # requests on the bridge now (0 or 1)
        self.refused_log = RepeatedLog(
            log,
            "refused a request: {detail}",
            "refused {count} more requests in the last {seconds:.0f} s; the last: {detail}",
        )

    def setup(self, cleanup: ExitStack) -> None:
        cfg = self.config
        cleanup.callback(self.refused_log.flush)
        self.keys = keys = node_keys(cfg.net, self.node_id)
        if keys is not None:  # a node's own key file names it
            self.node_id = keys.name
        torch.set_num_threads(cfg.rollout.torch_threads)
        device = resolve_device(cfg.rollout.device, "rollout.device")
        tokenizer = load_tokenizer(resolve_model(cfg.model.name, cfg.model.cache_dir))
        self.teachers = load_teachers(self.names, cfg.model, tokenizer, device)
        self.vocab_size: int = min(t.model.config.vocab_size for t in self.teachers.values())
        self.gpu = GpuMonitor.for_devices([device])  # NVML; nothing on CPUs
        cleanup.callback(self.gpu.close)
        dht = start_dht(cfg.swarm, keys)
        cleanup.callback(dht.shutdown)
        self.directory = Directory(dht, cfg.swarm, keys)
        cleanup.callback(self.directory.withdraw, self.node_id)
        self.maddrs = visible_maddrs(dht)
        self.server = Server(
            cfg.net.teacher_endpoint,
            protocol.teacher_request_decoder,
            cfg.net.max_message_bytes,
            keys,
        )
        cleanup.callback(self.server.close)
        self.endpoint = cfg.swarm.announce_endpoint or self.server.endpoint
        self.waiting: asyncio.Queue[Waiting] = asyncio.Queue(MAX_WAITING)
        self.metrics = MetricsWriter(Path(cfg.run.dir), "teacher", cfg.log)
        cleanup.callback(self.metrics.close)
        log.info(
            "teacher node %s ready: %s, serving %s on %s",
            self.node_id,
            self.endpoint,
            ", ".join(self.names),
            device,
        )

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await supervise(
                stop,
                {
                    "teacher-receive": self._receive(),
                    "teacher-score": self._score(),
                    "teacher-heartbeat": self._heartbeat(),
                },
            )
        finally:
            self.metrics.write({"event": "stopped", **self.counts})

    async def _receive(self) -> None:
        while True:
            envelope, msg = await self.server.recv()
            if isinstance(msg, protocol.Hello):
                await self.server.reply(
                    envelope, protocol.answer_hello(msg, self.config.swarm.run_id)
                )
                continue
            wrong = self._problem(msg)
            if wrong is not None:
                self.counts["requests_refused"] += 1
                self.refused_log.note(f"{wrong} (from {msg.node_id[:100]!r})")
                await self.server.reply(envelope, protocol.Error(code="invalid", message=wrong))
                continue
            try:
                self.waiting.put_nowait((envelope, msg, self.teachers[msg.teacher]))
            except asyncio.QueueFull:
                self.counts["requests_busy"] += 1
                busy = f"{MAX_WAITING} requests are waiting: ask again later"
                await self.server.reply(envelope, protocol.Error(code="busy", message=busy))

    def _problem(self, msg: protocol.TeacherScoreRequest) -> str | None:
        """Why this request cannot be scored, or None."""
        if msg.teacher not in self.teachers:
            return (
                f"no teacher {msg.teacher[:200]!r} here (this node serves {', '.join(self.names)})"
            )
        if not (math.isfinite(msg.temperature) and 0 < msg.temperature <= MAX_TEMPERATURE):
            return f"temperature {msg.temperature} is not in (0, {MAX_TEMPERATURE}]"
        if not 0 <= msg.top_k <= protocol.MAX_TOP_K:
            return f"top k {msg.top_k} is not in [0, {protocol.MAX_TOP_K}]"
        if not 0 < len(msg.samples) <= MAX_SAMPLES:
            return f"{len(msg.samples)} samples (1 to {MAX_SAMPLES})"
        for i, sample in enumerate(msg.samples):
            wrong = protocol.check_tokens(sample, self.vocab_size, MAX_SEQUENCE_TOKENS)
            if wrong is not None:
                return f"sample {i}: {wrong}"
        return None

    async def _score(self) -> None:
        while True:
            envelope, msg, teacher = await self.waiting.get()
            start = time.monotonic()
            self.scoring = 1
            try:
                scores = await blocking(teacher.scores, msg.samples, msg.temperature, msg.top_k)
            except (RuntimeError, ValueError) as e:  # torch: out of memory, a shape it refused
                self.counts["requests_failed"] += 1
                log.error("scoring for %s failed: %s", msg.node_id, e)
                failed = protocol.Error(code="invalid", message=f"scoring failed: {e}"[:500])
                await self.server.reply(envelope, failed)
                continue
            finally:
                self.scoring = 0
            reply = protocol.TeacherScores(
                logprobs=[protocol.pack_floats(s.logprobs) for s in scores],
                top_ids=[protocol.pack_ids(s.top_ids) for s in scores if s.top_ids is not None],
                top_logprobs=[
                    protocol.pack_floats(s.top_logprobs)
                    for s in scores
                    if s.top_logprobs is not None
                ],
            )
            await self.server.reply(envelope, reply)
            end = time.monotonic()
            self.samples_per_s = self.sample_rate.add(start, end, len(msg.samples))
            self.counts["samples_scored"] += len(msg.samples)
            self.metrics.write(
                {
                    "event": "scored",
                    "teacher": msg.teacher,
                    "node": msg.node_id,
                    "samples": len(msg.samples),
                    "tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in msg.samples)
                    // 4,
                    "score_s": round(end - start, 4),
                    "waiting": self.waiting.qsize(),
                    "perf/samples_per_s": self.samples_per_s,
                    **self.counts,
                }
            )

    async def _heartbeat(self) -> None:
        while True:
            record = protocol.NodeRecord(
                node_id=self.node_id,
                role="teacher",
                endpoint=self.endpoint,
                maddrs=self.maddrs,
                queue=self.waiting.qsize() + self.scoring,
                capacity=MAX_WAITING,
                samples_per_s=self.sample_rate.at(time.monotonic()),  # 0 when idle a while
                time=time.time(),
                gpus=self.gpu.sample(),
                teachers=self.names,
                refused=self.server.refusals(),
            )
            await blocking(self._publish, record)
            await asyncio.sleep(self.config.swarm.heartbeat_s)

    def _publish(self, record: protocol.NodeRecord) -> None:
        self.directory.publish(record)
        if self.keys is not None:  # revoked nodes are refused here too
            self.directory.sync_revocations(self.keys.membership)


def main(config: Config, names: list[str]) -> int:
    return run_role(TeacherNode(config, names), "teacher")
