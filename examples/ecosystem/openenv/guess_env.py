"""A number-guessing OpenEnv environment (openenv-core 0.3), and how agentjet turns the
model's reply into its action.

Serve it yourself:  uvicorn guess_env:app --port 8000   (then openenv_url)
or let agentjet:    openenv_app = "guess_env:app"        (see config.toml)
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 3


class GuessAction(Action):
    guess: int = Field(..., ge=0, le=9)


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(Environment):
    """reset(seed) draws a number 0-9; a right guess ends the episode with reward 1; a
    wrong one answers "higher" or "lower"; the third guess ends it."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session has its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.target = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="I picked a number from 0 to 9. Guess it: reply with it.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        assert isinstance(action, GuessAction)
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(prompt="Right!", done=True, reward=1.0)
        hint = "higher" if action.guess < self.target else "lower"
        last = self._state.step_count >= GUESSES
        return GuessObservation(prompt=f"No, {hint}. Guess again.", done=last, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


# max_concurrent_envs: the sessions it serves at once (agentjet's openenv_sessions).
app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)


def to_action(reply: str, observation: dict[str, Any]) -> GuessAction:
    """The reply's first digit as the guess; a reply without one is no action (the episode
    ends there, with the rewards it has)."""
    found = re.search(r"\d", reply)
    if found is None:
        raise ValueError("no number in the reply")
    return GuessAction(guess=int(found.group()))
