"""The house check (issue 48, "One house a newcomer can live in"): room sizes and import
layers of the product packages, held to limits by a ratchet.

Run it as `just house` (`just lint` and so CI run it too), or
`.venv/bin/python tests/house.py [--update [--allow-growth]] [--root DIR] [--baseline FILE]`.
It reads the code with `ast` only and imports none of it.

The limits, and why: a newcomer should find any one room small enough to read at a sitting.
- No class over MAX_CLASS_METHODS (20) methods or MAX_CLASS_LINES (450) lines: a role class
  wires named parts and drives them; the parts live in modules of their own.
- No module over MAX_MODULE_LINES (800) lines, unless it is one flat declarative table.
- No function over MAX_FUNCTION_LINES (80) lines, unless it is an argparse declaration (a
  flat run of statements that calls add_argument, like the CLI's build_parser).
- Layers (LAYERS): the kernel agentjet/ imports none of node/, sandboxes/, coordinator/,
  and none of those imports the app agentjet_app/, not even inside a function or under
  TYPE_CHECKING; each such import is an "upward arrow".
- No import circles between modules, counting imports inside functions and under
  TYPE_CHECKING (such an import still reflects a real dependency).
Lines are end_lineno - lineno + 1 of the node (docstrings included; a module: its file's
lines); a class's methods are the function defs directly in its body (properties count).

The code broke these limits in many places before the split began, so the check is a
ratchet: BASELINE lists each known violation with its size (only the numbers over a limit).
The check fails, one line per problem, when a violation appears that BASELINE lacks or a
recorded number grows; it notes (without failing) a recorded item that shrank or vanished:
then `--update` lowers BASELINE. `--update` refuses to raise a number or add an entry
unless `--allow-growth` is given, so nobody raises the ratchet by accident.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).with_name("house_baseline.json")

# The product packages by layer, bottom first: the kernel, the roles and their services,
# the app (CLI, `local`, dashboard, plot). A package imports only its own layer and those
# below; an import of a higher layer is an "upward arrow". A package not there is skipped.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("agentjet",),
    ("node", "sandboxes", "coordinator"),
    ("agentjet_app",),
)
PACKAGES = tuple(package for layer in LAYERS for package in layer)
LAYER_OF = {package: n for n, layer in enumerate(LAYERS) for package in layer}

MAX_CLASS_METHODS = 20
MAX_CLASS_LINES = 450
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
LIMITS: dict[str, dict[str, int]] = {
    "class": {"methods": MAX_CLASS_METHODS, "lines": MAX_CLASS_LINES},
    "module": {"lines": MAX_MODULE_LINES},
    "function": {"lines": MAX_FUNCTION_LINES},
}
TOP = 10  # how many of the largest rooms of each kind the report shows

# A violation's key ("class node/trainer.py:Trainer", "arrow a.py -> b.py", ...) and its
# numbers over their limits (none for arrows and circles: they count by being there).
Violations = dict[str, dict[str, int]]

_FLAT_STATEMENTS = (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return, ast.Pass)


@dataclass(frozen=True)
class Room:
    """A class, module or function: its name ("path" or "path:Qual.name") and its size."""

    kind: str
    name: str
    lines: int
    methods: int = 0
    table: bool = False  # one flat declarative table: exempt from the size limits

    def over(self) -> dict[str, int]:
        """The numbers past their limits (none for a table)."""
        if self.table:
            return {}
        sizes = {"lines": self.lines, "methods": self.methods}
        return {m: sizes[m] for m, limit in LIMITS[self.kind].items() if sizes[m] > limit}


@dataclass
class House:
    rooms: list[Room] = field(default_factory=list)
    imports: dict[str, set[str]] = field(default_factory=dict)  # file -> files it imports

    def largest(self, kind: str) -> list[Room]:
        rooms = [r for r in self.rooms if r.kind == kind]
        return sorted(rooms, key=lambda r: (-r.lines, -r.methods, r.name))[:TOP]

    def arrows(self) -> list[tuple[str, str]]:
        """Imports of a higher layer: (importing file, imported file)."""
        return sorted(
            (src, dst)
            for src, dsts in self.imports.items()
            for dst in dsts
            if LAYER_OF[_package(dst)] > LAYER_OF[_package(src)]
        )

    def circles(self) -> list[list[str]]:
        """Each set of modules that import one another round a loop, sorted."""
        return sorted(sorted(c) for c in _strongly_connected(self.imports) if len(c) > 1)

    def violations(self) -> Violations:
        found: Violations = {}
        for room in self.rooms:
            if over := room.over():
                key = f"{room.kind} {room.name}"
                sizes = found.setdefault(key, {})  # two defs of one name: the larger counts
                for metric, value in over.items():
                    sizes[metric] = max(value, sizes.get(metric, 0))
        for src, dst in self.arrows():
            found[f"arrow {src} -> {dst}"] = {}
        for circle in self.circles():
            found[f"circle {' <-> '.join(circle)}"] = {}
        return found


def _package(path: str) -> str:
    return path.split("/", 1)[0]


def _module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path) -> House:
    """Read every module of PACKAGES under root: its rooms and its imports of the others."""
    sources: dict[str, ast.Module] = {}
    house = House()
    for package in PACKAGES:
        files = sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []
        for file in files:
            path = file.relative_to(root).as_posix()
            text = file.read_text(encoding="utf-8")
            tree = ast.parse(text, filename=path)
            sources[path] = tree
            table = _is_table_module(tree)
            house.rooms.append(Room("module", path, len(text.splitlines()), table=table))
            house.rooms.extend(_rooms(tree.body, path, ""))
    modules = {_module_name(path): path for path in sources}
    for path, tree in sources.items():
        targets = {modules[name] for name in _imported(tree, path, modules)}
        house.imports[path] = targets - {path}
    return house


def _rooms(body: list[ast.stmt], path: str, prefix: str) -> Iterator[Room]:
    """The classes and functions in body, nested ones included, named by their qualname."""
    for node in body:
        for child in _defs(node):
            name = f"{prefix}{child.name}"
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            if isinstance(child, ast.ClassDef):
                methods = sum(
                    isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in child.body
                )
                yield Room("class", f"{path}:{name}", lines, methods)
            else:
                yield Room("function", f"{path}:{name}", lines, table=_is_argparse_table(child))
            yield from _rooms(child.body, path, f"{name}.")


def _defs(node: ast.stmt) -> Iterator[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    """The defs at node: node itself, or those inside its if/try/with/for blocks."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield node
        return
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
            yield from _defs(child)
        elif isinstance(child, ast.ExceptHandler | ast.match_case):
            for stmt in child.body:
                yield from _defs(stmt)


def _is_argparse_table(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A flat run of statements (no branch, loop or nested def) that declares arguments."""
    return all(isinstance(s, _FLAT_STATEMENTS) for s in fn.body) and any(
        isinstance(n, ast.Attribute) and n.attr == "add_argument" for n in ast.walk(fn)
    )


def _is_table_module(tree: ast.Module) -> bool:
    """Only imports, assignments and argparse tables: one flat declarative table."""
    return all(
        isinstance(s, ast.Import | ast.ImportFrom | ast.Assign | ast.AnnAssign | ast.Expr)
        or (isinstance(s, ast.FunctionDef) and _is_argparse_table(s))
        for s in tree.body
    )


def _imported(tree: ast.Module, path: str, modules: Mapping[str, str]) -> Iterator[str]:
    """The scanned modules this module imports anywhere (in functions, under TYPE_CHECKING)."""
    here = _module_name(path)
    package = here if path.endswith("/__init__.py") else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for name in names:
            if found := _longest_known(name, modules):
                yield found


def _longest_known(name: str, modules: Mapping[str, str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in modules:
            return prefix
    return None


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def compare(current: Violations, baseline: Violations) -> tuple[list[str], list[str]]:
    """Problems (a new violation, a recorded number grown) and notices (shrunk, gone)."""
    problems: list[str] = []
    notices: list[str] = []
    for key, sizes in sorted(current.items()):
        if key not in baseline:
            problems.append(f"new: {key} {_sizes(key, sizes)}".rstrip())
            continue
        for metric, value in sorted(sizes.items()):
            was = baseline[key].get(metric)
            if was is None:
                problems.append(f"new: {key} {metric} {value} (limit {_limit(key, metric)})")
            elif value > was:
                problems.append(f"grew: {key} {metric} {was} -> {value}")
    for key, recorded in sorted(baseline.items()):
        if key not in current:
            notices.append(f"gone: {key}")
            continue
        for metric, was in sorted(recorded.items()):
            now = current[key].get(metric)
            if now is None or now < was:
                shown = "within its limit" if now is None else str(now)
                notices.append(f"shrank: {key} {metric} {was} -> {shown}")
    return problems, notices


def _limit(key: str, metric: str) -> int:
    return LIMITS[key.split(" ", 1)[0]][metric]


def _sizes(key: str, sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{m} {v} (limit {_limit(key, m)})" for m, v in sorted(sizes.items()))


def load_baseline(path: Path) -> Violations:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    violations: Violations = data["violations"]
    return violations


def write_baseline(path: Path, violations: Violations) -> None:
    data = {
        "about": "Known violations of tests/house.py's limits (issue 48): lower it with "
        "`just house --update`; raising it needs --allow-growth and a reason.",
        "violations": violations,
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def report(house: House) -> list[str]:
    """The largest rooms of each kind, every upward arrow, every circle."""
    modules = [r for r in house.rooms if r.kind == "module"]
    scanned = {_package(r.name) for r in modules}
    over = {kind: sum(bool(r.over()) for r in house.rooms if r.kind == kind) for kind in LIMITS}
    lines = [
        f"house: {len(modules)} modules, {sum(r.lines for r in modules)} lines in "
        f"{', '.join(p + '/' for p in PACKAGES if p in scanned)}; over the limits: "
        f"{over['class']} classes, {over['module']} modules, {over['function']} functions"
    ]
    lines += [f"largest classes (limit {MAX_CLASS_METHODS} methods, {MAX_CLASS_LINES} lines):"]
    lines += [
        f"  {r.lines:5} lines {r.methods:3} methods  {r.name}{_mark(r)}"
        for r in house.largest("class")
    ]
    for kind, limit in (("module", MAX_MODULE_LINES), ("function", MAX_FUNCTION_LINES)):
        lines.append(f"largest {kind}s (limit {limit} lines):")
        lines += [f"  {r.lines:5} lines  {r.name}{_mark(r)}" for r in house.largest(kind)]
    arrows = house.arrows()
    layers = " < ".join(", ".join(layer) for layer in LAYERS)
    lines.append(f"upward arrows (layers: {layers}): {len(arrows)}")
    lines += [f"  {src} -> {dst}" for src, dst in arrows]
    circles = house.circles()
    lines.append(f"import circles: {len(circles)}")
    lines += [f"  {' <-> '.join(circle)}" for circle in circles]
    return lines


def _mark(room: Room) -> str:
    if room.table:
        return "  (flat table, exempt)"
    return "  OVER" if room.over() else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository to check")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="the known violations")
    parser.add_argument("--update", action="store_true", help="rewrite the baseline to the tree")
    parser.add_argument(
        "--allow-growth", action="store_true", help="with --update: let it add or raise entries"
    )
    args = parser.parse_args(argv)
    if args.allow_growth and not args.update:
        parser.error("--allow-growth goes with --update")
    house = scan(args.root)
    current = house.violations()
    baseline = load_baseline(args.baseline)
    problems, notices = compare(current, baseline)
    if args.update:
        if problems and not args.allow_growth:
            for problem in problems:
                print(f"house: refused to raise the baseline: {problem}")
            print("house: make the room smaller, or pass --allow-growth with a reason to raise it")
            return 1
        write_baseline(args.baseline, current)
        print(f"house: wrote {len(current)} known violations to {args.baseline}")
        return 0
    for line in report(house):
        print(line)
    left = sum(key in baseline for key in current)
    print(f"baselined violations left: {left} (in {args.baseline.name})")
    for notice in notices:
        print(f"house notice: {notice} (run `just house --update` to lower the baseline)")
    for problem in problems:
        print(f"house FAIL: {problem}")
    if problems:
        print(
            "house: make those rooms smaller or remove those imports (a split that only moved "
            "known code: `just house --update --allow-growth` once, and say why)"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
