"""One run dir, one node of each role (agentjet/rundir.py): the lock, the holder's line,
the default run dir that names the node."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentjet.config import load_config
from agentjet.rundir import DirectoryHeld, default_run_dir, describe_holder, hold_run_dir
from agentjet_app.cli import main as cli_main
from agentjet_app.local import run_local

pytestmark = pytest.mark.unit


def test_a_held_run_dir_is_refused_per_role_and_free_once_released(tmp_path: Path) -> None:
    first = hold_run_dir(tmp_path, "trainer", "alice")
    assert (tmp_path / "trainer.lock").read_text() == f"{os.getpid()} trainer alice\n"
    with pytest.raises(DirectoryHeld) as refused:
        hold_run_dir(tmp_path, "trainer")
    assert str(refused.value) == (
        f"run dir {tmp_path} is held by a live trainer node (pid {os.getpid()}, alice): stop "
        "that one, or give this one another run dir (--run-dir DIR, or run.dir)"
    )
    with hold_run_dir(tmp_path, "rollout"):  # roles keep apart files: `agentjet local`
        pass
    first.release()
    with hold_run_dir(tmp_path, "trainer"):
        assert (tmp_path / "trainer.lock").read_text() == f"{os.getpid()} trainer\n"


def test_the_holders_line_names_it_and_says_when_it_has_exited() -> None:
    assert (
        describe_holder(f"{os.getpid()} coordinator\n") == f"a live coordinator (pid {os.getpid()})"
    )
    # (pid_max is at most 2**22 on Linux: no process has this pid)
    gone = describe_holder("4999999 trainer alice\n")
    assert gone == "what is left of a trainer node (pid 4999999, alice, exited; wait a moment)"
    assert describe_holder("") == "another process"  # taken, its line not written yet
    assert describe_holder("junk") == "another process"


def test_a_nodes_default_run_dir_names_it(tmp_path: Path, keys_file: Path) -> None:
    def default(*overrides: str) -> str | None:
        return default_run_dir("trainer", load_config(None, list(overrides)))

    assert cli_main(["keys", "issue", "--node", "alice", "--keys", str(keys_file),
                     "--out", str(tmp_path / "alice.keys")]) == 0  # fmt: skip
    assert default(f'net.keys="{tmp_path / "alice.keys"}"') == "runs/alice"
    assert default(f'net.keys="{keys_file}"') == "runs/trainer"  # the root file names no node
    assert default('swarm.identity_path="/k/gpu0.id"') == "runs/trainer-gpu0"
    assert default(f'run.dir="{tmp_path}"') is None  # the config names one


def test_the_coordinator_defaults_to_a_run_dir_of_its_own(
    tmp_path: Path,
    keys_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["coordinator", "--keys", str(keys_file), "--dry-run"]) == 0
    assert "run dir: runs/coordinator (--run-dir to choose another)" in capsys.readouterr().out
    assert (tmp_path / "runs" / "coordinator" / "config.toml").is_file()


def test_a_second_local_run_on_a_live_run_dir_is_refused_before_writing(tmp_path: Path) -> None:
    config = load_config(None, [f'run.dir="{tmp_path}"'])
    with hold_run_dir(tmp_path, "local"), pytest.raises(DirectoryHeld, match="`agentjet local`"):
        run_local(config, tmp_path)
    assert not (tmp_path / "config.toml").exists()
