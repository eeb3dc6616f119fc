"""The sandbox image on a real docker engine: built once per machine, then reused as is,
and the programs environments run work inside it."""

from __future__ import annotations

import docker
import pytest

import sandboxes.image
from sandboxes.image import DEFAULT_IMAGE, build_image

pytestmark = pytest.mark.docker

# Python with the stdlib test programs use, and the coreutils the docker backend uses.
PROGRAM = (
    "python3 -c 'import json, unittest; print(json.dumps({\"sum\": sum(range(10))}))' "
    "&& timeout 5 sleep 0 && echo aGkK | base64 -d | cat"
)


def test_existing_image_is_reused_and_runs_python(
    docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not docker_client.images.list(name=DEFAULT_IMAGE):
        build_image()  # ~40 s, once per machine; needs root and debootstrap
    expected = docker_client.images.get(DEFAULT_IMAGE).id

    def no_rebuild(*args: object) -> None:
        raise AssertionError("build_image ran debootstrap although the image exists")

    monkeypatch.setattr(sandboxes.image, "_debootstrap", no_rebuild)
    lines: list[str] = []
    assert build_image(progress=lines.append) == expected
    assert len(lines) == 1 and "already built" in lines[0]

    output = docker_client.containers.run(
        DEFAULT_IMAGE,
        ["/bin/sh", "-c", PROGRAM],
        remove=True,
        network_mode="none",
        user="nobody",
        read_only=True,
    )
    assert output == b'{"sum": 45}\nhi\n'
