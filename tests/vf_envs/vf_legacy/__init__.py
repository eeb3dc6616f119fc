"""A verifiers v0-style environment package: `load_environment()` returning a
SingleTurnEnv. verifiers 0.4.0 has no `SingleTurnEnv` (its API is the v1 Taskset), so
agentjet refuses it at config load with one line; nothing here is ever called."""

from __future__ import annotations

from typing import Any


def load_environment(**kwargs: Any) -> Any:
    import verifiers as vf

    return vf.SingleTurnEnv(**kwargs)  # type: ignore[attr-defined]
