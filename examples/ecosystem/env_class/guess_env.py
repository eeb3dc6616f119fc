"""A TRL-style environment class: guess the row's secret number with a tool.

Written as for TRL's `environment_factory` (no agentjet import): agentjet makes one
instance per episode, calls `reset(**row)` with the task file's row, offers `guess` to the
model as a tool (its schema from the type hints and the docstring's "Args:"), and scores
the episode with `get_reward()`. Standard library only, so `sandbox = true` can run it in
the docker image too.
"""

from __future__ import annotations


class GuessTheNumber:
    def reset(self, secret: int, low: int, high: int, **row: object) -> str:
        """The row's columns arrive as keyword arguments (id, prompt and answer too)."""
        self.secret = secret
        self.guesses: list[int] = []
        # Appended to the row's prompt, as TRL does.
        return f" It is between {low} and {high}. Call guess with a number; you have 4 tries."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.

        Returns:
            "higher", "lower" or "right".
        """
        if len(self.guesses) >= 4:
            raise ValueError("no tries left")  # the model is told: "Error: ValueError: ..."
        self.guesses.append(number)
        if number == self.secret:
            return "right"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        """1 for a right guess, less for each try it took; 0 without one."""
        if self.secret not in self.guesses:
            return 0.0
        return 1.0 - 0.2 * self.guesses.index(self.secret)
