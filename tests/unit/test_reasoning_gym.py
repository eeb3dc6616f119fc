"""The "reasoning_gym" environment with the real reasoning-gym package: rows made from ids,
held-out rows apart from training ones, the dataset's scorer as the reward, scheduler cells,
and a bad config refused at load in one line naming the key."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer

from agentjet.config import EnvConfig, load_config
from agentjet.episode import SamplingParams
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.reasoning_gym_tasks import GymTasks, ScoreError
from agentjet.tasks import TaskSource, held_out_tasks
from coordinator.envsched import cell_of
from coordinator.envsched_status import cell_name
from node.verify import reward_checkers
from sandboxes.envs import ReasoningGymEnv, make_env
from tests.factories import RuleGenerator

pytestmark = pytest.mark.unit

ENV = """
[[envs]]
name = "reasoning_gym"
eval_rows = 5
tasks = [
  {name = "leg_counting", weight = 1, config = {min_animals = 1, max_animals = 2}},
  {name = "leg_counting", weight = 1, config = {min_animals = 3, max_animals = 4}},
  {name = "basic_arithmetic", weight = 2, config = {max_terms = 2, max_digits = 1}},
]
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "rg.toml"
    path.write_text(ENV)
    return path


@pytest.fixture
def env(config_file: Path) -> EnvConfig:
    return load_config(config_file).envs[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_drawn_tasks_are_rebuilt_from_their_ids_and_held_out_rows_are_apart(
    env: EnvConfig,
) -> None:
    source = TaskSource.from_config(env)
    rng = random.Random(7)
    drawn = [source.sample(rng) for _ in range(60)]
    assert {t.op for t in drawn} == {"leg_counting", "basic_arithmetic"}
    for task in drawn:
        assert source.find(task.id) == task  # a trainer's re-check rebuilds the same task
        assert source.covers(task)
        assert int(task.id.rpartition(":")[2]) < env.train_rows
    held_out = held_out_tasks(env)
    assert len(held_out) == 3 * env.eval_rows
    assert all(int(t.id.rpartition(":")[2]) >= env.train_rows for t in held_out)
    assert all(source.find(t.id) is None and not source.covers(t) for t in held_out)
    # a task of another config (another seed) is no task of this one
    other = TaskSource.from_config(msgspec.structs.replace(env, task_seed=1))
    assert source.find(other.sample(rng).id) is None
    assert source.find("leg_counting#1:5") is None


def test_each_config_of_a_dataset_is_a_scheduler_cell(env: EnvConfig) -> None:
    gym = GymTasks.from_config(env)
    first, second, arithmetic = (gym.held_out()[i * env.eval_rows] for i in range(3))
    assert (first.op, first.difficulty) == ("leg_counting", 1)
    assert (second.op, second.difficulty) == ("leg_counting", 2)
    assert (arithmetic.op, arithmetic.difficulty) == ("basic_arithmetic", 0)  # listed once
    assert len({cell_of(first), cell_of(second), cell_of(arithmetic)}) == 3
    assert cell_name(cell_of(second)) == "reasoning_gym d2 leg_counting"
    assert cell_name(cell_of(arithmetic)) == "reasoning_gym basic_arithmetic"


def test_the_datasets_scorer_is_the_reward(env: EnvConfig) -> None:
    gym = GymTasks.from_config(env)
    task = gym.held_out()[0]
    assert gym.score(task, f"I think <answer>{task.answer}</answer>") == 1.0
    assert gym.score(task, f"{task.answer}") == 0.0  # reasoning-gym's way: tags or nothing
    lenient = GymTasks.from_config(msgspec.structs.replace(env, rg_answer="tags_or_last_number"))
    assert lenient.score(task, f"2 cats make {task.answer} legs.") == 1.0
    assert lenient.score(task, "no idea") == 0.0
    with pytest.raises(ScoreError, match="differs"):
        gym.score(msgspec.structs.replace(task, prompt="another question"), "<answer>1</answer>")
    with pytest.raises(ScoreError, match="neither"):
        gym.score(Task(id="x", env="reasoning_gym", prompt="q"), "<answer>1</answer>")


def test_a_row_of_reasoning_gyms_own_shape_is_scored_by_its_metadata(env: EnvConfig) -> None:
    """An eval_file of rows as reasoning-gym writes them: scored by metadata.source_dataset."""
    import reasoning_gym

    row = reasoning_gym.create_dataset("leg_counting", seed=3, size=5)[2]
    metadata = msgspec.json.decode(msgspec.json.encode(row["metadata"]))  # as read from JSONL
    task = Task(id="r2", env="reasoning_gym", prompt=row["question"], answer=row["answer"],
                fields={"metadata": metadata})  # fmt: skip
    gym = GymTasks.from_config(env)
    assert gym.score(task, f"<answer>{row['answer']}</answer>") == 1.0
    assert gym.score(task, "<answer>-1</answer>") == 0.0


def test_episodes_get_the_score_per_task_metrics_and_failures_counted(
    env: EnvConfig, tokenizer: Any
) -> None:
    rg_env = make_env(env)
    assert isinstance(rg_env, ReasoningGymEnv)
    tasks = held_out_tasks(env)[:1] + held_out_tasks(env)[-1:]
    answers = {task.prompt: str(task.answer) for task in tasks}

    def reply(context: str) -> str:  # right on the first task, wrong on the second
        answer = next((a for q, a in answers.items() if q in context), "7")
        return f"<answer>{answer if 'legs' in context else 'no'}</answer>"

    generator = RuleGenerator(tokenizer, reply)
    junk = Task(
        id="leg_counting#9.0000:1", env="reasoning_gym", prompt="How many?", op="leg_counting"
    )
    groups = asyncio.run(rg_env.run_group(generator, [*tasks, junk], 2, SamplingParams()))
    assert [[e.reward for e in g] for g in groups] == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert groups[0][0].reward_terms == {"leg_counting": 1.0}
    assert groups[1][0].reward_terms == {"basic_arithmetic": 0.0}
    assert all(e.error == "" for g in groups[:2] for e in g)
    assert all(e.error.startswith("reward ") for e in groups[2])  # left be by re-checks
    assert rg_env.metrics() == {"reward/errors": 2}
    # the trainer's re-check agrees
    check = reward_checkers([env])["reasoning_gym"]
    completions = [e.completion_ids for e in groups[0]]
    assert asyncio.run(check(tokenizer, completions, tasks[0])) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('envs.0.tasks=[{name="leg_countin"}]',
         "envs.0.tasks.0.name: reasoning-gym has no dataset 'leg_countin' (did you mean "
         "leg_counting"),
        ('envs.0.tasks=[{name="gcd"}, {name="leg_counting", config={min_animal=1}}]',
         "envs.0.tasks.1.config.min_animal: leg_counting has no setting 'min_animal' (did "
         "you mean min_animals"),
        ('envs.0.tasks=[{name="leg_counting", config={min_animals=5, max_animals=1}}]',
         "envs.0.tasks.0.config: reasoning-gym refused leg_counting"),
        ('envs.0.tasks=[{name="gcd", config={seed=1}}]', "envs.0.tasks.0.config.seed: set by"),
        ("envs.0.tasks=[]", "envs.0.tasks: a 'reasoning_gym' environment needs tasks"),
        ('envs.0.rg_system_prompt="terse"', "envs.0.rg_system_prompt: unknown prompt 'terse'"),
        ('envs.0.task_file="rows.jsonl"', "envs.0.task_file: a 'reasoning_gym' environment"),
        ('envs.0.name="arithmetic"', 'envs.0.tasks: only "reasoning_gym" environments'),
    ],
)  # fmt: skip
def test_a_bad_config_is_one_line_at_load(config_file: Path, setting: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(config_file, [setting])
    assert f"config error at {message}" in str(raised.value)
    assert "\n" not in str(raised.value)
