"""The pure parts of node/openenv_env.py: answers checked, actions and turns made,
rewards added up, the config's rules. Hand-computed expectations."""

from __future__ import annotations

import math

import msgspec
import pytest

from agentjet.config import EnvConfig
from agentjet.config_checks import _check_env
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from node.openenv_env import (
    OpenEnvFault,
    as_action,
    episode_reward,
    parse_result,
    render_observation,
    reset_kwargs,
    text_field,
)

pytestmark = pytest.mark.unit


def test_an_answer_is_checked_field_by_field() -> None:
    result = parse_result({"observation": {"prompt": "hi"}, "reward": 1, "done": True})
    assert (result.observation, result.reward, result.done) == ({"prompt": "hi"}, 1.0, True)
    assert parse_result({"observation": {}, "reward": None, "done": False}).reward is None
    assert parse_result({"observation": {}, "reward": True, "done": False}).reward == 1.0
    bad = [
        "text",
        {"reward": 0.0, "done": False},
        {"observation": [], "done": False},
        {"observation": {}, "reward": 0.0},
        {"observation": {}, "reward": math.nan, "done": False},
        {"observation": {}, "reward": math.inf, "done": False},
        {"observation": {}, "reward": "1", "done": False},
    ]
    for payload in bad:
        with pytest.raises(OpenEnvFault):
            parse_result(payload)


def test_the_default_action_is_the_one_text_field() -> None:
    echo = {"properties": {"message": {"type": "string"}, "metadata": {"type": "object"}},
            "required": ["message"]}  # fmt: skip
    assert text_field(echo) == "message"
    optional_other = {"properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}
    assert text_field(optional_other | {"required": ["text"]}) == "text"
    assert text_field(optional_other | {"required": ["text", "n"]}) is None
    two = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    assert text_field(two) is None
    assert text_field({"properties": {"x": {"type": "integer"}}}) is None
    assert text_field(None) is None


def test_an_observation_is_its_text_else_its_json() -> None:
    assert render_observation({"prompt": "Guess.", "left": 3}) == "Guess."
    assert render_observation({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert render_observation({"board": [1, 2]}) == '{"board": [1, 2]}'


def test_reset_takes_the_task_fields_and_an_episode_id_of_its_own() -> None:
    task = Task(id="seed:7", env="openenv", prompt="p", fields={"seed": 7, "level": "hard"})
    first, second = reset_kwargs(task), reset_kwargs(task)
    assert {k: first[k] for k in ("seed", "level")} == {"seed": 7, "level": "hard"}
    assert first["episode_id"].endswith("-seed:7") and first["episode_id"] != second["episode_id"]
    assert len(reset_kwargs(Task(id="x" * 400, env="openenv", prompt="p"))["episode_id"]) == 255


def test_actions_and_rewards() -> None:
    assert as_action({"guess": "5"}) == {"guess": "5"}
    with pytest.raises(TypeError):
        as_action("5")
    assert episode_reward([0.0, None, 1.0], "sum") == 1.0
    assert episode_reward([0.5, 0.25], "sum") == 0.75
    assert episode_reward([0.5, None], "last") == 0.0
    assert episode_reward([], "last") == episode_reward([], "sum") == 0.0


def entry(**keys: object) -> EnvConfig:
    return msgspec.convert({"name": "openenv"} | keys, EnvConfig)


def test_an_openenv_entry_names_one_server() -> None:
    _check_env(entry(openenv_url="http://127.0.0.1:8000"), 0)
    _check_env(entry(openenv_app="my_env.server:app", openenv_action="my_env:to_action"), 0)
    refused = {
        "needs openenv_url": entry(),
        "one of them": entry(openenv_url="http://h:1", openenv_app="m:app"),
        "is not http": entry(openenv_url="127.0.0.1:8000"),
        "is not module:name": entry(openenv_app="m:app", openenv_action="to_action"),
        "agent, judge and external": entry(openenv_app="m:app", external=True),
    }
    for words, config in refused.items():
        with pytest.raises(ConfigError, match=words):
            _check_env(config, 0)
    with pytest.raises(ConfigError, match='envs.0.openenv_url: only "openenv"'):
        _check_env(msgspec.convert({"name": "agent", "agent": "m:f",
                                    "openenv_url": "http://h:1"}, EnvConfig), 0)  # fmt: skip
