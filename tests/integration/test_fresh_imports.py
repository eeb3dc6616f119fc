"""What a fresh Python interpreter imports, and sees when a package is missing (a process
of its own: the test process has imported everything already): the dashboard loads no
torch and nothing of node, the metrics module no torch, other commands no matplotlib, and
tensorboard missing is one line that says what to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import procs

pytestmark = pytest.mark.integration


def test_the_dashboard_loads_no_torch_and_nothing_of_node() -> None:
    code = (
        "import sys, agentjet_app.dashboard.server; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'node')); "
        "assert not heavy, heavy"
    )
    done = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_tensorboard_not_installed_is_one_line_that_says_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['tensorboard'] = None  # as if it were not installed\n"
        "from agentjet.config import LogConfig\n"
        "from agentjet.metrics import MetricsWriter\n"
        f"MetricsWriter({str(tmp_path)!r}, 'trainer', LogConfig(backends=['tensorboard']))\n"
    )
    done = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("agentjet.errors.ConfigError: config error at log.backends")
    assert "pip install tensorboard" in last


def test_the_metrics_module_does_not_import_torch() -> None:
    code = "import agentjet.metrics, sys; assert 'torch' not in sys.modules"
    procs.run([sys.executable, "-c", code], check=True, timeout=60)


def test_other_commands_do_not_import_matplotlib() -> None:
    code = (
        "import sys, agentjet_app.cli, agentjet_app.plot; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    done = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
