"""The default docker sandbox image, built offline from the Debian packages this machine uses.

    /etc/apt sources ──▶ (mirror, suite) ──▶ debootstrap --variant=minbase --include=python3
        ──▶ rootfs in /var/tmp ──▶ trimmed (apt lists, docs, man pages, other locales)
        ──▶ tar stream ──▶ docker import (PATH, LANG, WORKDIR /work, CMD sleep infinity)
        ──▶ check: /bin/sh, python3 with its stdlib and coreutils run in a container

debootstrap's steps (each line it prints: retrieving, unpacking, configuring a package) and
the bytes of the tar stream are shown as they go (agentjet/progress.py: a bar on a terminal,
a line every few seconds otherwise). No `docker build` runs, so there are no build steps.

No image registry is reachable where this project runs, but the apt mirror the host installs
from is, so the image is made from those packages. Building needs root (debootstrap chroots
and creates device nodes) and takes ~30 s; an image already present is reused unless forced.
Run it as `agentjet sandbox build-image` (or `just sandbox-image`).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

import docker
import docker.errors
import requests.exceptions
from docker.utils import parse_repository_tag

from agentjet.progress import ProgressReport
from sandboxes.base import SandboxError
from sandboxes.docker_sandbox import DEFAULT_IMAGE, connect

# Debian's release codenames and aliases: the suites debootstrap can start from. Suites of
# fixes on top of a release (bookworm-security, -updates, -backports) and third-party suites
# (nodesource's "nodistro") are not among them.
DEBIAN_SUITES = frozenset(
    {"buster", "bullseye", "bookworm", "trixie", "forky", "duke", "sid"}
    | {"oldoldstable", "oldstable", "stable", "testing", "unstable"}
)
# Values of a deb822 `Enabled:` field that switch a stanza off (apt's false words).
_FALSE_WORDS = frozenset({"no", "false", "off", "without", "disable"})
# On disk, not in a tmpfs /tmp: the rootfs takes ~300 MB and holds device nodes.
BUILD_PARENT_DIR = "/var/tmp"
# A slow mirror takes a few minutes; past this, debootstrap is stuck.
DEBOOTSTRAP_TIMEOUT_S = 900
# Lines of debootstrap's output, and of its log, quoted when it fails: where it says why.
FAILURE_TAIL_LINES = 3
# Bytes per read of the tar stream sent to docker: the rootfs never sits in memory whole.
TAR_CHUNK_BYTES = 1 << 20
# The image's settings. The container idles on `sleep infinity`; programs run by exec.
IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    "WORKDIR /work",
    'CMD ["sleep", "infinity"]',
)
# Run in the new image (no network): /bin/sh, python3 with the stdlib test programs use, and
# the coreutils shell tasks use. It prints "ok".
SMOKE_TEST = 'python3 -c "import json, unittest" && echo b2sK | base64 -d | timeout 5 cat'
# Emptied in the rootfs: a sandbox never runs apt (no network), nobody reads docs there, and
# docker mounts its own /dev.
TRIMMED_DIRS = (
    "var/lib/apt/lists",
    "var/cache/apt",
    "var/log",
    "usr/share/man",
    "usr/share/info",
    "dev",
)


def apt_mirror(root: str | Path = "/") -> tuple[str, str]:
    """(mirror URL, suite) of the first Debian release archive in the apt sources under `root`.

    Reads /etc/apt/sources.list, then sources.list.d/*.list and *.sources by name, as apt
    does; an entry counts when it is a `deb` entry with the `main` component and a Debian
    release suite (see DEBIAN_SUITES).
    """
    apt = Path(root) / "etc/apt"
    parts = apt / "sources.list.d"
    candidates = [apt / "sources.list"]
    if parts.is_dir():
        candidates += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    files = [path for path in candidates if path.is_file()]
    for path in files:
        text = path.read_text(errors="replace")
        entries = _deb822_entries(text) if path.suffix == ".sources" else _one_line_entries(text)
        for url, suite, components in entries:
            if suite in DEBIAN_SUITES and "main" in components:
                return url, suite
    read = ", ".join(str(path) for path in files) or f"no sources file under {apt}"
    raise SandboxError(
        f"no Debian release archive (a `deb` entry for e.g. bookworm, component main) in {read};"
        " give the mirror and suite explicitly (--mirror URL --suite SUITE)"
    )


def _one_line_entries(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """`deb [options] URL SUITE COMPONENTS…` lines as (URL, suite, components)."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        rest = words[1:]
        if rest and rest[0].startswith("["):  # options, possibly with spaces inside [ ]
            end = next((i for i, word in enumerate(rest) if word.endswith("]")), len(rest))
            rest = rest[end + 1 :]
        if len(rest) >= 3:
            yield rest[0], rest[1], rest[2:]


def _deb822_entries(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """Enabled `Types: deb` stanzas as (URL, suite, components), one per URL and suite."""
    stanza: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():  # a blank line ends a stanza
            enabled = stanza.get("enabled", "yes").lower() not in _FALSE_WORDS
            if enabled and "deb" in stanza.get("types", "").split():
                components = stanza.get("components", "").split()
                for url in stanza.get("uris", "").split():
                    for suite in stanza.get("suites", "").split():
                        yield url, suite, components
            stanza = {}
        elif not line.startswith("#") and not line[0].isspace():
            # Comments and continuation lines (an inline Signed-By key) hold no field we read.
            key, _, value = line.partition(":")
            stanza[key.strip().lower()] = value.strip()


def build_image(
    tag: str = DEFAULT_IMAGE,
    *,
    mirror: str | None = None,
    suite: str | None = None,
    packages: Sequence[str] = ("python3",),
    force: bool = False,
    progress: Callable[[str], None] = print,
    out: TextIO | None = None,
) -> str:
    """Build `tag` from Debian packages (see the module docstring) and return its image id.

    An existing `tag` is returned as is unless `force`. `mirror` and `suite` default to the
    machine's apt sources (`apt_mirror`). Progress goes to `progress`, one line at a time, and
    that of debootstrap and the import to `out` (default stdout), a bar on a terminal.
    """
    out = out if out is not None else sys.stdout
    client = connect()
    try:
        if not force and (existing := _image_id(client, tag)):
            progress(f"{tag} is already built ({_short(existing)}); --force rebuilds it")
            return existing
        debootstrap = _debootstrap_command()
        if mirror is None or suite is None:
            apt_url, apt_suite = apt_mirror()
            mirror, suite = mirror or apt_url, suite or apt_suite
        started = time.monotonic()
        build_dir = Path(tempfile.mkdtemp(prefix="agentjet-image-", dir=BUILD_PARENT_DIR))
        try:
            rootfs = build_dir / "rootfs"
            progress(
                f"debootstrap {suite} (minbase + {', '.join(packages) or 'nothing'}) "
                f"from {mirror} into {rootfs}; this takes ~30 s"
            )
            _debootstrap(debootstrap, rootfs, mirror, suite, packages, out)
            _trim(rootfs)
            tar_bytes = _tar_bytes(rootfs)
            progress(
                f"rootfs ready in {time.monotonic() - started:.0f} s "
                f"({tar_bytes / 1e6:.0f} MB); importing it into docker as {tag}"
            )
            with ProgressReport("docker import", tar_bytes, "B", out) as report:
                image_id = _import(client, rootfs, tag, report.update)
                report.total = report.done  # what was sent, in place of the estimate
        finally:
            _remove_build_dir(build_dir, progress)
        _smoke_test(client, tag, image_id)
        size_mb = client.images.get(image_id).attrs["Size"] / 1e6
        elapsed_s = time.monotonic() - started
        progress(f"built {tag} ({_short(image_id)}, {size_mb:.0f} MB) in {elapsed_s:.0f} s")
        return image_id
    finally:
        client.close()


def _image_id(client: docker.DockerClient, tag: str) -> str | None:
    try:
        return str(client.images.get(tag).id)
    except docker.errors.ImageNotFound:
        return None


def _debootstrap_command() -> str:
    """The debootstrap executable, after checking that it can run here."""
    # As a user, sbin may be missing from PATH although debootstrap is installed there.
    path = shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if path is None:
        raise SandboxError("debootstrap is not installed: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise SandboxError(
            "building the sandbox image needs root (debootstrap chroots and creates device "
            "nodes): run it again as root, e.g. with sudo"
        )
    return path


def _debootstrap(
    debootstrap: str,
    rootfs: Path,
    mirror: str,
    suite: str,
    packages: Sequence[str],
    out: TextIO,
) -> None:
    """Run debootstrap, showing each line it prints as a step on `out`."""
    include = [f"--include={','.join(packages)}"] if packages else []
    argv = [debootstrap, "--variant=minbase", *include, suite, str(rootfs), mirror]
    deadline = time.monotonic() + DEBOOTSTRAP_TIMEOUT_S
    output: list[str] = []
    with (
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process,
        ProgressReport("debootstrap", unit="steps", out=out) as steps,
    ):
        for line in _output_lines(process, deadline):
            output.append(line)
            steps.update(1, line.removeprefix("I: "))
        try:
            returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            raise SandboxError(
                f"debootstrap did not finish within {DEBOOTSTRAP_TIMEOUT_S} s; "
                f"is {mirror} reachable?"
            ) from None
    if returncode != 0:
        # Its output often only points at its log, which is deleted with the rootfs.
        log = rootfs / "debootstrap/debootstrap.log"
        log_lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        tail = _tail(output) + _tail(log_lines)
        raise SandboxError(f"debootstrap failed (exit {returncode}): {' | '.join(tail)}")


def _output_lines(process: subprocess.Popen[bytes], deadline: float) -> Iterator[str]:
    """`process`'s output, a line at a time as it comes, until it closes its output or the
    clock passes `deadline` (a hung mirror)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while selector.select(timeout=max(0.0, deadline - time.monotonic())):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            yield from (line.decode(errors="replace") for line in lines if line.strip())
    if pending.strip():
        yield pending.decode(errors="replace")


def _tail(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()][-FAILURE_TAIL_LINES:]


def _trim(rootfs: Path) -> None:
    """Drop what a sandbox never uses, keeping the license files (as Debian's slim images do)
    and the C locales; then add the work dir the image starts in."""
    for relative in TRIMMED_DIRS:
        _remove_children(rootfs / relative)
    docs = rootfs / "usr/share/doc"
    _remove_children(docs, keep=lambda path: path.is_dir() and not path.is_symlink())
    for package_docs in docs.iterdir() if docs.is_dir() else ():
        _remove_children(package_docs, keep=lambda path: path.name == "copyright")
    _remove_children(
        rootfs / "usr/share/locale",
        keep=lambda path: not path.is_dir() or path.name == "C" or path.name.startswith("C."),
    )
    (rootfs / "work").mkdir(exist_ok=True)


def _remove_children(directory: Path, keep: Callable[[Path], bool] = lambda path: False) -> None:
    if not directory.is_dir() or directory.is_symlink():
        return
    for child in directory.iterdir():
        if keep(child):
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _tar_bytes(root: Path) -> int:
    """About the size of `root` as a tar stream: a 512-byte header per entry, and file data
    padded to 512 bytes (long names' extra headers and the end-of-archive blocks left out)."""
    total = 0
    for parent, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            info = os.lstat(os.path.join(parent, name))
            data = info.st_size if stat.S_ISREG(info.st_mode) else 0
            total += 512 + -(-data // 512) * 512
    return total


def _import(
    client: docker.DockerClient, rootfs: Path, tag: str, sent: Callable[[int], object]
) -> str:
    """Stream `rootfs` as a tar into `docker import`, telling `sent` each chunk's size; the
    new image's id."""
    repository, image_tag = parse_repository_tag(tag)
    argv = ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."]
    with tempfile.TemporaryFile() as tar_errors:
        tar = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=tar_errors)
        tar_out = tar.stdout
        assert tar_out is not None
        stream = _counted(iter(lambda: tar_out.read(TAR_CHUNK_BYTES), b""), sent)
        try:
            reply = client.api.import_image_from_data(
                stream, repository=repository, tag=image_tag, changes=list(IMAGE_CHANGES)
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            raise SandboxError(f"docker could not import the rootfs as {tag}: {e}") from None
        finally:
            tar_out.close()  # a tar still writing (import failed) gets EPIPE and ends
            tar.wait()
        if tar.returncode != 0:
            tar_errors.seek(0)
            message = _tail(tar_errors.read().decode(errors="replace").splitlines())
            raise SandboxError(f"tar of the rootfs failed: {' | '.join(message)}")
    # The engine answers with JSON lines: {"status": "sha256:…"} or {"error": "…"}.
    messages = [json.loads(line) for line in reply.splitlines() if line.strip()]
    errors = [str(message["error"]) for message in messages if "error" in message]
    if errors or not messages:
        raise SandboxError(f"docker could not import the rootfs as {tag}: {errors or reply!r}")
    return str(messages[-1]["status"])


def _counted(chunks: Iterator[bytes], sent: Callable[[int], object]) -> Iterator[bytes]:
    for chunk in chunks:
        yield chunk
        sent(len(chunk))


def _smoke_test(client: docker.DockerClient, tag: str, image_id: str) -> None:
    """Run SMOKE_TEST in the new image; remove the image if it fails, so it is not reused."""
    try:
        output = client.containers.run(
            image_id, ["/bin/sh", "-c", SMOKE_TEST], remove=True, network_mode="none"
        )
        failure = "" if output == b"ok\n" else f"printed {output!r} instead of 'ok'"
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        failure = " ".join(str(e).split())
    if failure:
        client.images.remove(image_id, force=True)
        raise SandboxError(f"the new image {tag} fails its check and was removed: {failure}")


def _remove_build_dir(path: Path, progress: Callable[[str], None]) -> None:
    """Delete the build dir. A debootstrap killed midway leaves proc, sys and binds of the
    host's /dev mounted in the rootfs: unmount them first, and never cross into a file system
    still mounted there (`rm --one-file-system`), so nothing of the host is deleted."""
    prefix = f"{path}/"
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = [line.split()[4] for line in mountinfo if line.split()[4].startswith(prefix)]
    for mount_point in sorted(mounts, reverse=True):  # nested mounts first
        subprocess.run(["umount", "--lazy", mount_point], capture_output=True)
    done = subprocess.run(
        ["rm", "-rf", "--one-file-system", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        progress(f"warning: could not remove {path}: {' | '.join(_tail(done.stderr.splitlines()))}")


def _short(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:12]
