"""Building the sandbox image: finding the Debian mirror in apt's sources, trimming the
rootfs, and one clear line for every reason a build cannot start."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import sandboxes.image
from agentjet_app.cli import main
from sandboxes.base import SandboxError
from sandboxes.image import (
    _debootstrap_command,
    _trim,
    apt_mirror,
    build_image,
)

pytestmark = pytest.mark.unit

MIRROR = "http://mirror.example/debian"
OTHER = "http://other.example/debian"
FIRST = "http://first.example/debian"
SECURITY = "http://security.example/debian-security"


def apt_root(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake filesystem root holding `files` under etc/apt."""
    for name, text in files.items():
        path = tmp_path / "etc/apt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


@pytest.mark.parametrize(
    "options",
    [
        "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]",
        "[ arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg ]",
        "",
    ],
)
def test_one_line_entry_with_or_without_options(tmp_path: Path, options: str) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list": f"""\
                # the machine's mirror
                deb-src {OTHER} bookworm main
                deb {options} {MIRROR} bookworm main contrib  # trailing comment
                deb {OTHER} trixie main
            """
        },
    )
    assert apt_mirror(root) == (MIRROR, "bookworm")


def test_deb822_stanzas_with_comments_and_a_multiline_key(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list.d/debian.sources": f"""\
                # sources in deb822 format
                Types: deb-src
                URIs: {OTHER}
                Suites: bookworm
                Components: main

                Types: deb
                # a snapshot of the archive, commented out: {OTHER}
                URIs: {MIRROR}
                Suites: bookworm-updates bookworm
                Components: main
                Signed-By:
                 -----BEGIN PGP PUBLIC KEY BLOCK-----
                 .
                 Suites: not-a-field
                 -----END PGP PUBLIC KEY BLOCK-----

                Types: deb
                URIs: {OTHER}
                Suites: trixie
                Components: main
            """
        },
    )
    assert apt_mirror(root) == (MIRROR, "bookworm")


def test_disabled_stanzas_are_skipped(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list.d/debian.sources": f"""\
                Types: deb
                URIs: {OTHER}
                Suites: bookworm
                Components: main
                Enabled: no

                Types: deb
                URIs: {MIRROR}
                Suites: trixie
                Components: main
                Enabled: yes
            """
        },
    )
    assert apt_mirror(root) == (MIRROR, "trixie")


def test_security_updates_backports_and_third_party_suites_are_skipped(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list": f"""\
                deb {SECURITY} bookworm-security main
                deb {OTHER} bookworm-updates main
                deb {OTHER} bookworm-backports main
                deb https://nodejs.example/node_20.x nodistro main
                deb https://tools.example/linux/debian bookworm stable
                deb {MIRROR} bookworm main
            """
        },
    )
    assert apt_mirror(root) == (MIRROR, "bookworm")


def stanza(url: str, suite: str) -> str:
    return f"Types: deb\nURIs: {url}\nSuites: {suite}\nComponents: main\n"


def test_files_are_read_in_apt_order_and_other_suffixes_ignored(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list.d/aa.list.disabled-by-farm": f"deb {OTHER} bookworm main\n",
            "sources.list.d/bb.sources.disabled-by-farm": stanza(OTHER, "bookworm"),
            "sources.list.d/cc.list": f"deb {SECURITY} bookworm-security main\n",
            "sources.list.d/dd.sources": stanza(MIRROR, "bookworm"),
            "sources.list.d/ee.list": f"deb {OTHER} bookworm main\n",
        },
    )
    assert apt_mirror(root) == (MIRROR, "bookworm")
    (root / "etc/apt/sources.list").write_text(f"deb {FIRST} bookworm main\n")
    assert apt_mirror(root) == (FIRST, "bookworm")


def test_no_debian_entry_is_an_error_naming_the_files_read(tmp_path: Path) -> None:
    root = apt_root(
        tmp_path,
        {
            "sources.list.d/debian.sources": stanza(SECURITY, "bookworm-security"),
            "sources.list.d/mirror.list.disabled-by-farm": f"deb {MIRROR} bookworm main\n",
        },
    )
    with pytest.raises(SandboxError, match="--mirror URL --suite SUITE") as error:
        apt_mirror(root)
    assert str(root / "etc/apt/sources.list.d/debian.sources") in str(error.value)
    assert "disabled-by-farm" not in str(error.value)
    with pytest.raises(SandboxError, match="no sources file under"):
        apt_mirror(tmp_path / "empty")


def test_trim_drops_docs_caches_and_locales_but_keeps_licenses_and_python(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    kept = [
        "usr/bin/python3",
        "usr/lib/python3.11/json/__init__.py",
        "usr/share/doc/python3/copyright",
        "usr/share/locale/C.utf8/LC_MESSAGES/x.mo",
        "etc/apt/sources.list",
    ]
    dropped = [
        "usr/share/doc/python3/changelog.Debian.gz",
        "usr/share/man/man1/python3.1.gz",
        "usr/share/info/dir",
        "usr/share/locale/de/LC_MESSAGES/apt.mo",
        "var/lib/apt/lists/mirror_dists_bookworm_InRelease",
        "var/cache/apt/pkgcache.bin",
        "var/log/dpkg.log",
        "dev/null",
    ]
    for relative in kept + dropped:
        (rootfs / relative).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / relative).write_text("x")
    _trim(rootfs)
    assert [path for path in kept if not (rootfs / path).exists()] == []
    assert [path for path in dropped if (rootfs / path).exists()] == []
    assert (rootfs / "var/lib/apt/lists").is_dir() and (rootfs / "work").is_dir()


def test_missing_debootstrap_or_root_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandboxes.image.shutil, "which", lambda name, path=None: None)
    with pytest.raises(SandboxError, match="apt-get install debootstrap"):
        _debootstrap_command()
    monkeypatch.setattr(sandboxes.image.shutil, "which", lambda name, path=None: "/sbin/x")
    monkeypatch.setattr(sandboxes.image.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="needs root"):
        _debootstrap_command()


def test_unreachable_docker_says_how_to_start_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")
    with pytest.raises(SandboxError, match="dockerd --iptables=false --bridge=none") as error:
        build_image()
    assert "\n" not in str(error.value)


def test_cli_sandbox_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["sandbox", "--help"], ["sandbox", "build-image", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
    assert "build-image" in capsys.readouterr().out


def test_cli_build_image_passes_options_and_reports_errors_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, dict[str, object]]] = []

    def fake_build(tag: str, **options: object) -> str:
        calls.append((tag, options))
        return "sha256:0123"

    monkeypatch.setattr(sandboxes.image, "build_image", fake_build)
    assert main(["sandbox", "build-image"]) == 0
    assert main(["sandbox", "build-image", "--tag", "t:1", "--mirror", MIRROR, "--force"]) == 0
    assert calls == [
        (sandboxes.image.DEFAULT_IMAGE, {"mirror": None, "suite": None, "force": False}),
        ("t:1", {"mirror": MIRROR, "suite": None, "force": True}),
    ]

    def failing_build(tag: str, **options: object) -> str:
        raise SandboxError("debootstrap is not installed: apt-get install debootstrap")

    monkeypatch.setattr(sandboxes.image, "build_image", failing_build)
    capsys.readouterr()
    assert main(["sandbox", "build-image"]) == 2
    err = capsys.readouterr().err
    assert err == "agentjet: error: debootstrap is not installed: apt-get install debootstrap\n"
