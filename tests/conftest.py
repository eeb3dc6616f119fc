"""Fixtures shared by every test tier.

`tiny_model_dir` is a random SmolLM2-shaped model saved as an HF folder (built once per
session; the SmolLM2 tokenizer is converted from the embedded GGUF once and cached).
Tests that run torch call `one_torch_thread` so parallel test runs on small boxes do not
fight over cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node.model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run the test on one intra-op thread, restoring the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
