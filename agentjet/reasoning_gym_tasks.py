"""reasoning-gym's datasets as agentjet tasks: rows generated on the fly, scored by the
dataset's own scorer. The one module that imports reasoning_gym (lazily: the package loads
only where a "reasoning_gym" environment is configured; it never imports torch, so the
coordinator draws these tasks too).

    [[envs]] tasks = [{name, weight, config}, ...], task_seed, train_rows, eval_rows
        ──▶ one Entry per listed dataset: reasoning_gym.create_dataset(name, seed=task_seed,
            size=train_rows + eval_rows, **config), made once per process (cached)
    GymTasks.sample(rng) ──entry by weight, row index in [0, train_rows)──▶ Task
        id "<name>#<k>.<digest>:<index>": the k-th entry of that name (1-based), a digest of
        its config and seed, the row's index; op = name, difficulty = k when the name is
        listed several times (else 0): each (name, config) is one scheduler cell
    GymTasks.held_out() ──each entry's rows [train_rows, train_rows + eval_rows)──▶ Tasks
    GymTasks.find(id) / covers(task) ──the id parsed, the row generated again──▶ the same Task
    GymTasks.score(task, completion) ──the row again, its question checked against the
        task's──▶ reasoning_gym.utils.extract_answer (the last <answer>...</answer>)
        ──▶ dataset.score_answer(answer, row) ∈ [0, 1]   (raises ScoreError otherwise)

Rows are never shipped with their metadata (any Python object): every process that needs a
row (the coordinator drawing, the rollout node scoring, a trainer re-checking) makes it from
the id, and the same seed makes the same row. The digest keeps a task of an older config
from being taken for a row of the new one: it is then not found, not mis-scored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import random
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentjet.errors import ConfigError
from agentjet.protocol import Task

if TYPE_CHECKING:
    from agentjet.config_schema import EnvConfig, ReasoningGymTask

INSTALL = "pip install 'agentjet[reasoning-gym]'"
# reasoning-gym's own mixture; listing several entries under `tasks` is agentjet's.
REFUSED = {"composite": "list its datasets as entries of tasks instead"}
# The value of rg_system_prompt that keeps the chat template's own system message.
MODEL_PROMPT = "model"
_ID = re.compile(r"(?P<name>\w+)#(?P<k>\d+)\.(?P<digest>[0-9a-f]{4}):(?P<index>\d+)")

# A number as a completion writes it (sign, thousands commas, decimals).
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_datasets: dict[tuple[str, int, int, str], Any] = {}  # made once per process: see `_dataset`
_scorers: dict[str, Any] = {}  # a dataset name -> its default config's scorer
_datasets_lock = threading.Lock()


class ScoreError(Exception):
    """A completion could not be scored; the message is the kind of failure (one log line
    per kind), the sample scores 0."""


def reasoning_gym(where: str) -> Any:
    """The reasoning_gym package, or one ConfigError line saying how to install it."""
    try:
        import reasoning_gym as package
    except ImportError as e:
        raise ConfigError(
            f"{where}: name = 'reasoning_gym' needs the reasoning-gym package: {INSTALL} ({e})"
        ) from None
    return package


def system_prompt(name: str, where: str = "config error at envs") -> str | None:
    """The system message rg_system_prompt names (None: the chat template's own)."""
    if name == MODEL_PROMPT:
        return None
    prompts: dict[str, str] = reasoning_gym(where).utils.SYSTEM_PROMPTS
    if name not in prompts:
        allowed = ", ".join([*prompts, MODEL_PROMPT])
        raise ConfigError(f"{where}.rg_system_prompt: unknown prompt {name!r} (allowed: {allowed})")
    return prompts[name]


@dataclass(frozen=True)
class Entry:
    """One listed dataset: the k-th entry of its name, its cell's difficulty, its weight."""

    name: str
    k: int
    difficulty: int
    weight: float
    digest: str
    dataset: Any  # a reasoning_gym ProceduralDataset


class GymTasks:
    """The tasks of one "reasoning_gym" environment: drawn, rebuilt from ids, scored."""

    def __init__(
        self,
        env: str,
        tasks: Sequence[ReasoningGymTask],
        seed: int = 0,
        train_rows: int = 100_000,
        eval_rows: int = 50,
        fallback: str = "",
        where: str = "config error at envs",
    ) -> None:
        """Makes (or takes from the cache) every entry's dataset and one row of each, so a
        bad config is one ConfigError naming the key (`where`: the entry's key) now."""
        package = reasoning_gym(where)
        self.env, self.train_rows, self.eval_rows = env, train_rows, eval_rows
        self.fallback = fallback  # "" (tags only), "last_number" or "text": see `answer`
        self.extract_answer = package.utils.extract_answer
        if not tasks:
            raise ConfigError(f"{where}.tasks: a 'reasoning_gym' environment needs tasks")
        names = [task.name for task in tasks]
        self.entries: list[Entry] = []
        for i, task in enumerate(tasks):
            key = f"{where}.tasks.{i}"
            _check_task(package, task, key)
            k = names[: i + 1].count(task.name)
            dataset = _dataset(task.name, seed, train_rows + eval_rows, task.config, key)
            digest = _digest(task.name, task.config, seed)
            if any(e.name == task.name and e.digest == digest for e in self.entries):
                raise ConfigError(f"{key}: {task.name!r} is listed twice with the same config")
            difficulty = k if names.count(task.name) > 1 else 0
            self.entries.append(Entry(task.name, k, difficulty, task.weight, digest, dataset))
        self.weights = [entry.weight for entry in self.entries]

    @classmethod
    def from_config(cls, env: EnvConfig, where: str = "config error at envs") -> GymTasks:
        return cls(
            env.name,
            env.tasks,
            env.task_seed,
            env.train_rows,
            env.eval_rows,
            env.rg_answer.removeprefix("tags").removeprefix("_or_"),
            where,
        )

    # ── tasks ────────────────────────────────────────────────────────────────────────

    def sample(self, rng: random.Random) -> Task:
        """A training row of an entry picked by weight."""
        [entry] = rng.choices(self.entries, weights=self.weights)
        return self._task(entry, rng.randrange(self.train_rows))

    def held_out(self) -> list[Task]:
        """Every entry's held-out rows, which no training draw reaches."""
        rows = range(self.train_rows, self.train_rows + self.eval_rows)
        return [self._task(entry, index) for entry in self.entries for index in rows]

    def find(self, task_id: str) -> Task | None:
        """The training task with this id, made again; None when this config never draws it."""
        found = self._parse(task_id)
        if found is None or found[1] >= self.train_rows:
            return None
        return self._task(*found)

    def covers(self, task: Task) -> bool:
        """Whether this config draws `task` (a task of an older config is not offered)."""
        found = self._parse(task.id)
        return found is not None and found[1] < self.train_rows and task.op == found[0].name

    def _parse(self, task_id: str) -> tuple[Entry, int] | None:
        match = _ID.fullmatch(task_id)
        if match is None:
            return None
        name, k, digest = match["name"], int(match["k"]), match["digest"]
        index = int(match["index"])
        for entry in self.entries:
            if (entry.name, entry.k, entry.digest) == (name, k, digest):
                return (entry, index) if index < self.train_rows + self.eval_rows else None
        return None

    def _task(self, entry: Entry, index: int) -> Task:
        row = entry.dataset[index]
        return Task(
            id=f"{entry.name}#{entry.k}.{entry.digest}:{index}",
            env=self.env,
            prompt=str(row["question"]),
            answer=_plain(row.get("answer")),
            op=entry.name,
            difficulty=entry.difficulty,
        )

    # ── scoring ──────────────────────────────────────────────────────────────────────

    def answer(self, completion: str) -> str | None:
        """The answer reasoning-gym reads from a completion: the last <answer>...</answer>;
        when it has none, with fallback "last_number" the completion's last number (none:
        no answer), with "text" all of it (stripped)."""
        answer: str | None = self.extract_answer(completion)
        if answer is None and self.fallback == "last_number":
            numbers = _NUMBER.findall(completion)
            answer = numbers[-1].replace(",", "") if numbers else None
        elif answer is None and self.fallback == "text":
            answer = completion.strip()
        return answer

    def score(self, task: Task, completion: str) -> float:
        """The dataset's score of the completion's answer, in [0, 1]. A task of this config
        is scored on its row made again; a task file's row (an eval_file of reasoning-gym's
        rows) on its own `metadata`, by the scorer of `metadata.source_dataset`. ScoreError
        when neither can be had, or the scorer raises or returns junk."""
        name, scorer, row = self._scorer_and_row(task)
        try:
            value = scorer(self.answer(completion), row)
        except Exception as e:  # noqa: BLE001 - the package's scorer failed on this answer
            raise ScoreError(f"{name}: the scorer raised {type(e).__name__}") from e
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, int | float) or not math.isfinite(value) or not 0 <= value <= 1:
            raise ScoreError(f"{name}: the scorer returned {value!r:.40}, not in [0, 1]")
        return float(value)

    def _scorer_and_row(self, task: Task) -> tuple[str, Any, dict[str, Any]]:
        found = self._parse(task.id)
        if found is not None:
            entry, index = found
            try:
                row = entry.dataset[index]
            except Exception as e:  # noqa: BLE001 - the package's generator failed
                raise ScoreError(f"{entry.name}: making the row raised {type(e).__name__}") from e
            if str(row["question"]) != task.prompt:
                raise ScoreError(f"{entry.name}: the row made again differs from the one drawn")
            return entry.name, entry.dataset.score_answer, row
        metadata = task.fields.get("metadata")
        name = metadata.get("source_dataset") if isinstance(metadata, dict) else None
        if not isinstance(name, str) or name not in reasoning_gym("").factory.DATASETS:
            raise ScoreError(
                "a task neither of this config nor a reasoning-gym row (metadata.source_dataset)"
            )
        row = {"question": task.prompt, "answer": task.answer, "metadata": metadata}
        return name, _default_scorer(name), row


def _check_task(package: Any, task: ReasoningGymTask, key: str) -> None:
    """The entry's name is a dataset of reasoning-gym's and its config's keys are fields of
    that dataset's config class (values are checked by making the dataset)."""
    import dataclasses

    datasets: dict[str, tuple[Any, Any]] = package.factory.DATASETS
    if task.name in REFUSED:
        raise ConfigError(f"{key}.name: {task.name!r} is not supported: {REFUSED[task.name]}")
    if task.name not in datasets:
        raise ConfigError(
            f"{key}.name: reasoning-gym has no dataset {task.name!r}"
            f"{_close(task.name, datasets)}; {len(datasets)} in all: reasoning_gym.factory.DATASETS"
        )
    fields = [f.name for f in dataclasses.fields(datasets[task.name][1])]
    for name in task.config:
        if name in ("seed", "size"):
            raise ConfigError(
                f"{key}.config.{name}: set by the environment (task_seed, train_rows, eval_rows)"
            )
        if name not in fields:
            allowed = ", ".join(f for f in fields if f not in ("seed", "size"))
            raise ConfigError(
                f"{key}.config.{name}: {task.name} has no setting {name!r}"
                f"{_close(name, fields)} (its settings: {allowed})"
            )


def _close(name: str, names: Sequence[str] | dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(names), n=4, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _dataset(name: str, seed: int, size: int, config: dict[str, Any], key: str) -> Any:
    """The dataset, made once per process for one (name, seed, size, config); making it (and
    its first row) raising is a ConfigError naming the entry."""
    cache_key = (name, seed, size, json.dumps(config, sort_keys=True, default=repr))
    with _datasets_lock:
        if cache_key in _datasets:
            return _datasets[cache_key]
        package = reasoning_gym(key)
        try:
            dataset = package.create_dataset(name, seed=seed, size=size, **config)
            dataset[0]
        except Exception as e:  # noqa: BLE001 - the package refused this config
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ConfigError(
                f"{key}.config: reasoning-gym refused {name} with {config}: "
                f"{type(e).__name__}{f': {detail}' if detail else ''}"
            ) from None
        _datasets[cache_key] = dataset
        return dataset


def _default_scorer(name: str) -> Any:
    """reasoning-gym's scorer of a dataset at its default config (get_score_answer_fn),
    made once per process."""
    with _datasets_lock:
        if name not in _scorers:
            _scorers[name] = reasoning_gym("").get_score_answer_fn(name)
        return _scorers[name]


def _digest(name: str, config: dict[str, Any], seed: int) -> str:
    text = json.dumps([name, config, seed], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:4]


def _plain(value: Any) -> Any:
    """A row's answer as a task carries it over the wire (JSON-like; anything else as text)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
