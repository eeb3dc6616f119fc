"""Wire messages: round trips, compact token arrays, and rejection of bad input."""

import msgspec
import numpy as np
import pytest

from agentjet import protocol
from agentjet.protocol import (
    Sample,
    TrajectoryGroup,
    check_group,
    pack_floats,
    pack_ids,
    pack_mask,
)
from tests.factories import make_group, make_sample

pytestmark = pytest.mark.unit


def with_samples(*samples: Sample) -> TrajectoryGroup:
    return msgspec.structs.replace(make_group(), samples=list(samples))


def test_submit_group_round_trip_keeps_exact_tokens():
    msg = protocol.SubmitGroup(group=make_group())
    decoded = protocol.trainer_request_decoder.decode(protocol.encode(msg))
    assert decoded == msg
    s = decoded.group.samples[0]
    assert protocol.unpack_ids(s.completion_ids).tolist() == [4, 5]
    assert protocol.unpack_floats(s.logprobs).tolist() == [-0.5, -1.25]


def test_token_arrays_are_compact():
    ids = np.arange(1000)
    sample = make_sample(prompt_ids=pack_ids(ids))
    # 4 bytes per token plus framing, not a msgpack int per token
    assert len(msgspec.msgpack.encode(sample)) < 4000 + 300


def test_every_coordinator_message_round_trips():
    task = protocol.Task(id="t", env="arithmetic", prompt="1+1?", answer=2, op="+", difficulty=1)
    for msg in [
        protocol.Hello(node_id="n", role="rollout"),
        protocol.WorkRequest(node_id="n", max_groups=4),
        protocol.GroupReport(node_id="n", grant_id="g", rewards=[1.0, 0.0]),
        protocol.Heartbeat(node_id="n", role="rollout", policy_version=2),
        protocol.StatusRequest(),
    ]:
        assert protocol.coordinator_request_decoder.decode(protocol.encode(msg)) == msg
    grants = protocol.WorkGrants(
        grants=[protocol.WorkGrant(grant_id="g", task=task, group_size=8, lease_s=60.0)]
    )
    assert protocol.coordinator_reply_decoder.decode(protocol.encode(grants)) == grants


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"t": "nope"}),
        msgspec.msgpack.encode({"t": "submit_group", "group": {"group_id": 1}}),
        msgspec.msgpack.encode({"t": "hello", "node_id": "n", "role": "rollout", "x": 1}),
        protocol.encode(protocol.Hello(node_id="n", role="rollout"))[:-3],  # truncated
    ],
)
def test_bad_payloads_raise_decode_errors(payload):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        protocol.trainer_request_decoder.decode(payload)


def test_wrong_protocol_version_is_refused():
    reply = protocol.answer_hello(
        protocol.Hello(node_id="n", role="rollout", protocol_version=99), "run"
    )
    assert isinstance(reply, protocol.Error) and reply.code == "version"
    ok = protocol.answer_hello(protocol.Hello(node_id="n", role="rollout"), "run", 7)
    assert ok == protocol.Welcome(run_id="run", policy_version=7)


@pytest.mark.parametrize(
    ("sample", "problem"),
    [
        (make_sample(completion_ids=pack_ids([4, 99999])), "outside the vocabulary"),
        (make_sample(completion_ids=pack_ids([-1, 4])), "outside the vocabulary"),
        (make_sample(logprobs=pack_floats([-0.5])), "length differs"),
        (make_sample(loss_mask=pack_mask([1])), "length differs"),
        (make_sample(logprobs=pack_floats([0.5, -1.0])), "<= 0"),
        (make_sample(logprobs=pack_floats([float("nan"), -1.0])), "finite"),
        (make_sample(reward=float("inf")), "finite"),
        (make_sample(completion_ids=b"\x01\x02\x03"), "whole int32"),
        (make_sample(prompt_ids=b""), "empty"),
        (make_sample(prompt_ids=pack_ids(range(200))), "tokens (at most 100)"),
        (make_sample(policy_version=-1), "negative policy version"),
    ],
)
def test_check_group_names_the_problem(sample, problem):
    reason = check_group(with_samples(sample), vocab_size=1000, max_tokens=100)
    assert reason is not None and problem in reason


def test_check_group_accepts_a_well_formed_group():
    assert check_group(make_group(), vocab_size=1000, max_tokens=100) is None
    assert "no samples" in check_group(with_samples(), 1000, 100)
