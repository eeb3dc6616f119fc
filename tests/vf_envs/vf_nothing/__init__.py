"""A package that is no verifiers environment: no Taskset, no load_environment."""

GREETING = "hello"
