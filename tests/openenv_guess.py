"""OpenEnv servers for the tests, built with the real openenv-core: a number-guessing game
(`app`), and a server that answers a reset with junk (`junk_app`).

Guess: reset(seed) draws a number 0-9 from the seed (or takes `target`); each step's
action is a text guess; a right guess ends the episode with reward 1, a wrong one says
"higher" or "lower" with reward 0, a guess that is no number is refused by the server
(its Action's pattern: the model's fault), and the third guess ends it.
"""

from __future__ import annotations

import random
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 3


class GuessAction(Action):
    # A pattern, not a validator raising ValueError: openenv-core 0.3.0 cannot send that
    # one's error back, and ends the session (SESSION_ERROR) instead of refusing the action.
    guess: str = Field(..., description="A number from 0 to 9", pattern=r"^\s*\d+\s*$")


class GuessObservation(Observation):
    prompt: str = ""
    guesses_left: int = GUESSES


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.target = int(kwargs.get("target", random.Random(seed).randrange(10)))
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess my number from 0 to 9. Reply with the number.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        assert isinstance(action, GuessAction)
        self._state.step_count += 1
        guess = int(action.guess)
        left = GUESSES - self._state.step_count
        if guess == self.target:
            return GuessObservation(prompt="Right!", guesses_left=left, done=True, reward=1.0)
        hint = "higher" if guess < self.target else "lower"
        wrong = GuessObservation(prompt=f"No, {hint}.", guesses_left=left, reward=0.0)
        wrong.done = left == 0
        return wrong

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)


def to_action(reply: str, observation: dict[str, Any]) -> GuessAction:
    """The reply's first number as the guess (a reply without one is no action)."""
    words = [w.strip(".,!") for w in reply.split()]
    return GuessAction(guess=next(w for w in words if w.isdigit()))


def show(observation: dict[str, Any]) -> str:
    return f"{observation['prompt']} ({observation['guesses_left']} guesses left)"


# A server that speaks openenv's routes but answers each reset with what its `junk` reset
# argument names: text that is not JSON, an answer without `done`, a reward that is no
# number, or nothing at all (it never answers).
junk_app = FastAPI()
JUNK = {
    "not_json": "this is not JSON",
    "no_done": '{"type": "observation", "data": {"observation": {"prompt": "hi"}}}',
    "bad_reward": '{"type": "observation", "data": {"observation": {}, "done": false, '
    '"reward": "lots"}}',
}


@junk_app.get("/health")
def health() -> dict[str, str]:
    return {"status": "healthy"}


@junk_app.get("/schema")
def schema() -> dict[str, Any]:
    return {"action": GuessAction.model_json_schema(), "observation": {}, "state": {}}


@junk_app.websocket("/ws")
async def junk_session(websocket: WebSocket) -> None:
    import json

    await websocket.accept()
    try:
        while True:
            message = json.loads(await websocket.receive_text())
            kind = message.get("data", {}).get("junk", "")
            if kind in JUNK:
                await websocket.send_text(JUNK[kind])
    except WebSocketDisconnect:
        pass
