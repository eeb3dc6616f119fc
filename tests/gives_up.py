"""`python -m tests.gives_up ARGS` runs `agentjet ARGS` with one fault: the trainer gives
up on every gradient round just as the round completes, as when its averaging timeout
strikes at that moment. Its peers step with its gradients, and it must not train them
again (node/trainer_doubtful.py, `DoubtfulBatch`)."""

from __future__ import annotations

import sys
from typing import Any

from agentjet_app import cli
from node import optimizer


class GivesUp:
    """A gradient round's control whose result, once the round has completed, is a
    timeout."""

    def __init__(self, control: Any) -> None:
        self.control = control

    def result(self, timeout: float | None = None) -> Any:
        self.control.result(timeout)
        raise TimeoutError("the test's fault: given up just as the round completed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.control, name)


def give_up_on_every_round(optimizer_type: Any) -> None:
    average = optimizer_type._average_gradients_and_load_into_optimizer

    def giving_up(self: Any, control: Any) -> None:
        average(self, None if control is None else GivesUp(control))

    optimizer_type._average_gradients_and_load_into_optimizer = giving_up


if __name__ == "__main__":
    give_up_on_every_round(optimizer.HivemindOptimizer)
    sys.exit(cli.main())
