"""The house check (tests/house.py, issue 48) on small source trees written to tmp_path, and
on this repository: room sizes past their limits, upward imports, import circles, and the
baseline's ratchet."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests import house

pytestmark = pytest.mark.unit


def tree(root: Path, files: dict[str, str]) -> Path:
    """Every package of house.PACKAGES (empty __init__ files) and files (path -> source)."""
    for package in house.PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for path, source in files.items():
        (root / path).write_text(source)
    return root


def violations(root: Path, files: dict[str, str]) -> house.Violations:
    return house.scan(tree(root, files)).violations()


def cls(name: str, methods: int) -> str:
    body = "".join(f"    def m{i}(self) -> None:\n        pass\n" for i in range(methods))
    return f"class {name}:\n    @property\n    def p(self) -> int:\n        return 1\n{body}"


def function(name: str, lines: int) -> str:
    """A def of exactly lines lines (its docstring counts)."""
    return f'def {name}() -> None:\n    """\n' + "    x\n" * (lines - 3) + '    """\n'


def run(root: Path, baseline: Path, *args: str) -> int:
    return house.main(["--root", str(root), "--baseline", str(baseline), *args])


def test_a_class_of_21_methods_is_reported_and_one_of_20_is_not(tmp_path: Path) -> None:
    found = violations(tmp_path, {"node/rooms.py": cls("Big", 20) + cls("Small", 19)})
    assert found == {"class node/rooms.py:Big": {"methods": 21}}  # the property counts


def test_a_class_over_450_lines_is_reported_with_its_line_count(tmp_path: Path) -> None:
    def long_class(lines: int) -> str:
        return 'class Long:\n    """\n' + "    x\n" * (lines - 3) + '    """\n'

    assert violations(tmp_path, {"node/long.py": long_class(450)}) == {}
    found = violations(tmp_path, {"node/long.py": long_class(451)})
    assert found == {"class node/long.py:Long": {"lines": 451}}


def test_a_module_of_801_lines_is_reported_but_not_800_nor_a_flat_table(tmp_path: Path) -> None:
    code = "def f() -> None:\n    pass\n"
    found = violations(
        tmp_path,
        {
            "sandboxes/long.py": code + "# a line\n" * 799,
            "sandboxes/fits.py": code + "# a line\n" * 798,
            "sandboxes/table.py": '"""A catalogue."""\n' + "X = [\n" + "    1,\n" * 900 + "]\n",
        },
    )
    assert found == {"module sandboxes/long.py": {"lines": 801}}


def test_a_function_of_81_lines_is_reported_but_not_an_argparse_table(tmp_path: Path) -> None:
    argparse_table = (
        "def build_parser(p):\n" + '    p.add_argument("--x")\n' * 100 + "    return p\n"
    )
    found = violations(
        tmp_path,
        {
            "coordinator/fns.py": function("long", 81) + function("fits", 80) + argparse_table,
            "coordinator/nested.py": "class C:\n" + textwrap.indent(function("method", 90), "    "),
        },
    )
    assert found == {
        "function coordinator/fns.py:long": {"lines": 81},
        "function coordinator/nested.py:C.method": {"lines": 90},
    }


def test_an_import_of_a_higher_layer_is_an_arrow_even_inside_a_function(tmp_path: Path) -> None:
    found = violations(
        tmp_path,
        {
            "agentjet/app.py": "def main() -> None:\n    from node import worker\n",
            "agentjet/kernel.py": "import json\n",
            "node/worker.py": "from agentjet import kernel\nimport sandboxes\n",
            "sandboxes/box.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from agentjet_app.cli import main\n",
            "agentjet_app/cli.py": "from node.worker import kernel\nfrom agentjet import app\n",
        },
    )
    assert found == {
        "arrow agentjet/app.py -> node/worker.py": {},
        "arrow sandboxes/box.py -> agentjet_app/cli.py": {},
    }


@pytest.mark.parametrize(
    "b_imports_a",
    [
        "from node.a import A\n",
        "def f() -> None:\n    from . import a\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from node.a import A\n",
    ],
    ids=["module-level", "lazy-relative", "type-checking"],
)
def test_two_modules_that_import_each_other_are_a_circle(tmp_path: Path, b_imports_a: str) -> None:
    found = violations(
        tmp_path,
        {"node/a.py": "import node.b\nclass A:\n    pass\n", "node/b.py": b_imports_a},
    )
    assert found == {"circle node/a.py <-> node/b.py": {}}


def ratchet(tmp_path: Path, recorded: int, methods: int) -> tuple[Path, Path]:
    """A tree whose class has methods methods, and a baseline that records it at recorded."""
    root = tree(tmp_path / "repo", {"node/big.py": cls("Big", methods - 1)})
    baseline = tmp_path / "baseline.json"
    house.write_baseline(baseline, {"class node/big.py:Big": {"methods": recorded}})
    return root, baseline


def test_a_baselined_room_that_grows_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, baseline = ratchet(tmp_path, recorded=22, methods=23)
    assert run(root, baseline) == 1
    out = capsys.readouterr().out
    assert "house FAIL: grew: class node/big.py:Big methods 22 -> 23" in out


def test_a_new_violation_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, baseline = ratchet(tmp_path, recorded=22, methods=22)
    (root / "node" / "more.py").write_text(function("long", 81))
    assert run(root, baseline) == 1
    assert "house FAIL: new: function node/more.py:long lines 81 (limit 80)" in (
        capsys.readouterr().out
    )


def test_a_shrunk_room_passes_with_a_notice_and_update_lowers_the_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, baseline = ratchet(tmp_path, recorded=23, methods=22)
    assert run(root, baseline) == 0
    out = capsys.readouterr().out
    assert "house notice: shrank: class node/big.py:Big methods 23 -> 22" in out
    assert "--update" in out and "FAIL" not in out
    assert run(root, baseline, "--update") == 0
    assert house.load_baseline(baseline) == {"class node/big.py:Big": {"methods": 22}}
    (root / "node" / "big.py").write_text(cls("Big", 5))  # back within its limit: gone
    assert run(root, baseline) == 0
    assert "house notice: gone: class node/big.py:Big" in capsys.readouterr().out
    assert run(root, baseline, "--update") == 0
    assert house.load_baseline(baseline) == {}


def test_update_refuses_growth_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, baseline = ratchet(tmp_path, recorded=22, methods=23)
    before = baseline.read_text()
    assert run(root, baseline, "--update") == 1
    assert "refused" in capsys.readouterr().out
    assert baseline.read_text() == before
    assert run(root, baseline, "--update", "--allow-growth") == 0
    assert json.loads(baseline.read_text())["violations"] == {
        "class node/big.py:Big": {"methods": 23}
    }
    assert run(root, baseline) == 0


def test_this_repository_matches_its_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """A failure here names the room that grew or the new violation: make it smaller (or,
    after a split that moved code, `just house --update --allow-growth` once, with a reason)."""
    assert house.main([]) == 0, capsys.readouterr().out
