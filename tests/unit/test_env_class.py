"""TRL-style environment classes: the tools a class offers, as the model sees them, and
the one clear line for a class that cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentjet.config import config_from_dict
from agentjet.errors import ConfigError
from sandboxes.envs.env_class import EnvClassAgent, load_env_class, tool_schemas
from tests.env_classes import Calculator

pytestmark = pytest.mark.unit


def test_public_methods_are_tools_with_schemas_from_their_signatures_and_docstrings():
    schemas = {s["function"]["name"]: s["function"] for s in tool_schemas(Calculator)}
    # reset, _helper, the static method and the class attribute are no tools
    assert sorted(schemas) == ["add", "divide", "recall", "total"]
    divide = schemas["divide"]
    assert divide["description"] == "Divide a by b, and remember the result."
    assert divide["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "number", "description": "The dividend."},
            "b": {"type": "number", "description": "The divisor."},
        },
        "required": ["a", "b"],
    }
    # an argument with a default is optional; `X | None` may be null; async methods too
    assert schemas["add"]["parameters"]["required"] == ["a"]
    assert schemas["add"]["parameters"]["properties"]["b"]["type"] == "integer"
    recall = schemas["recall"]["parameters"]
    assert "required" not in recall  # nothing required
    assert recall["properties"]["label"] == {
        "type": "string",
        "nullable": True,
        "description": "A label to put before it.",
    }
    assert recall["properties"]["rounded"]["type"] == "boolean"
    assert schemas["total"]["parameters"]["properties"]["numbers"] == {
        "type": "array",
        "items": {"type": "integer"},
        "description": "The numbers to add.",
    }


def test_the_reward_source_is_known_at_load():
    assert load_env_class("tests.env_classes:GuessingGame").has_reward
    calculator = load_env_class("tests.env_classes:Calculator")
    assert not calculator.has_reward
    assert calculator.source == Path("tests/env_classes.py").read_bytes()
    with pytest.raises(ConfigError, match="has no get_reward.* nothing would score"):
        EnvClassAgent(calculator)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.no_such_module:Env", "environment 'tests.no_such_module:Env' cannot be loaded"),
        ("tests.env_classes:Missing", "environment 'tests.env_classes:Missing' cannot be loaded"),
        ("tests.rewards:even_length", "environment 'tests.rewards:even_length' is not a class"),
        ("tests.env_classes:NoReset", "environment 'tests.env_classes:NoReset' has no reset"),
        (
            "tests.env_classes:Undocumented",
            "environment 'tests.env_classes:Undocumented': tool 'move' cannot be offered to "
            "the model: Cannot generate JSON schema for move because the docstring has no "
            "description for the argument 'direction'",
        ),
    ],
)
def test_a_class_that_cannot_be_used_is_one_config_error(spec: str, message: str):
    with pytest.raises(ConfigError) as err:
        load_env_class(spec)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, 'envs.0.environment: the env_class environment needs environment = "module:Class"'),
        ({"environment": "my_env"}, "envs.0.environment: the env_class environment needs"),
        ({"environment": "my_env:MyEnv", "task_file": ""}, "envs.0.task_file: an env_class"),
        (
            {"environment": "e:E", "reward": "r:f", "rewards": [{"name": "a", "function": "r:g"}]},
            "envs.0.reward: give reward or [[envs.rewards]], not both",
        ),  # fmt: skip
        ({"environment": "e:E", "external": True}, "envs.0.external: an env_class environment"),
        (
            {"name": "agent", "agent": "a:f", "environment": "e:E"},
            'envs.0.environment: only "env_class" environments take environment',
        ),  # fmt: skip
        (
            {"name": "agent", "agent": "a:f", "sandbox": True},
            'envs.0.sandbox: only "env_class" environments take sandbox',
        ),  # fmt: skip
    ],
)
def test_config_errors_name_the_key(env: dict[str, object], message: str, tmp_path: Path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Guess.", "secret": 3}\n')
    entry = {"name": "env_class", "task_file": str(rows)} | env
    with pytest.raises(ConfigError) as err:
        config_from_dict({"envs": [entry]})
    assert str(err.value).startswith(f"config error at {message}")


def test_a_config_with_a_class_a_reward_and_the_sandbox_loads(tmp_path: Path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Guess.", "secret": 3}\n')
    entry = {
        "name": "env_class",
        "environment": "tests.env_classes:GuessingGame",
        "task_file": str(rows),
        "reward": "tests.rewards:even_length",
        "sandbox": True,
    }
    [env] = config_from_dict({"envs": [entry]}).envs
    assert env.sandboxed()  # the rollout node opens the sandbox pool for it
    assert not config_from_dict({"envs": [entry | {"sandbox": False}]}).envs[0].sandboxed()
