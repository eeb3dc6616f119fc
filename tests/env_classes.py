"""TRL-style environment classes for tests of "env_class" environments
(`environment = "tests.env_classes:NAME"`). Standard library only: with `sandbox = true`
this file is copied into the sandbox, whose image has python3 and nothing else."""

from __future__ import annotations

import asyncio
import threading


class GuessingGame:
    """Guess the row's secret number; `get_reward` is 1 when the last guess hit it."""

    def reset(self, secret: int, **row: object) -> str:
        self.secret = secret
        self.guesses: list[int] = []
        return " Call guess to guess it."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.

        Returns:
            Whether the secret is higher, lower, or right.
        """
        self.guesses.append(number)
        if number == self.secret:
            return "right"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return float(bool(self.guesses) and self.guesses[-1] == self.secret)


class Calculator:
    """Tools of every kind of argument, a tool that raises, and no get_reward."""

    RATE = 2  # an attribute: not a tool

    def reset(self, **row: object) -> None:
        self.memory = 0.0

    def divide(self, a: float, b: float) -> float:
        """Divide a by b, and remember the result.

        Args:
            a: The dividend.
            b: The divisor.
        """
        self.memory = a / b
        return self.memory

    async def add(self, a: int, b: int = 0) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        await asyncio.sleep(0)
        return a + b

    def recall(self, label: str | None = None, rounded: bool = False) -> str:
        """The remembered number.

        Args:
            label: A label to put before it.
            rounded: Whether to round it to an integer.
        """
        value = round(self.memory) if rounded else self.memory
        return f"{label}: {value}" if label else str(value)

    def total(self, numbers: list[int]) -> int:
        """The sum of numbers.

        Args:
            numbers: The numbers to add.
        """
        return sum(numbers)

    def _helper(self) -> None:
        """Private: not a tool."""

    @staticmethod
    def version() -> str:
        """A static method: not a tool."""
        return "1"


class Undocumented:
    def reset(self, **row: object) -> None:
        pass

    def move(self, direction: str) -> str:
        """Move somewhere (no Args section)."""
        return direction


class NoReset:
    def guess(self, number: int) -> str:
        """Guess.

        Args:
            number: The guess.
        """
        return str(number)


class RaisesInReset(GuessingGame):
    def reset(self, secret: int, **row: object) -> str:
        raise KeyError("no secret in this row")


class JunkReward(GuessingGame):
    def get_reward(self) -> float:
        return "great"  # type: ignore[return-value]


# In the node a hung tool's thread cannot be stopped: the test lets it go (RELEASE) and
# joins it (HUNG), so no thread outlives the test and counts as abandoned in the next one.
# In a sandbox nobody sets RELEASE: the sandbox kills the call.
RELEASE = threading.Event()
HUNG: list[threading.Thread] = []


class HangsInGuess(GuessingGame):
    """`guess` does not return until the test releases it (never, in a sandbox)."""

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        HUNG.append(threading.current_thread())
        RELEASE.wait(3600)
        return ""


class Unpicklable(GuessingGame):
    """Holds a lock, which cannot be pickled: fine here, refused in a sandbox."""

    def reset(self, secret: int, **row: object) -> str:
        self.lock = threading.Lock()
        return super().reset(secret, **row)
