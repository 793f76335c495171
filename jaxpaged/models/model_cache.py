"""A disk cache of what a GGUF file loads into: the config, the params (our layout, cast) and the tokenizer.

Loading a GGUF file costs seconds on every start (every tensor is dequantised,
the tokenizer is rebuilt); a later start reads the cached entry instead and never opens the GGUF file:

    <cache_dir>/<key>/meta.json           {"format", "source", "dtype", "config": LlamaConfig fields}
    <cache_dir>/<key>/params.safetensors  the params pytree, flattened ("embed", "layers.wq", ...)
    <cache_dir>/<key>/tokenizer/          the built tokenizer (`save_pretrained`)

key: sha256 of the file's absolute path, size and mtime, the requested dtype, the
`gguf` package's version and the source of the modules that build the entry, so a
changed file or loader never reads a stale entry. An entry is written into a
temporary folder and renamed into place, so a concurrent start never sees half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpaged.models.llama import LlamaConfig, Params

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_META, _PARAMS, _TOKENIZER = "meta.json", "params.safetensors", "tokenizer"
# Modules whose code decides an entry's contents (layout, dequantisation, tokenizer).
_BUILDERS = ("models/gguf_loader.py", "models/gguf_file.py", "models/llama.py", "models/params.py",
             "models/weights.py", "models/model_cache.py", "tokenizer.py")


def default_cache_dir(name: str) -> str:
    """$XDG_CACHE_HOME (else ~/.cache)/jaxpaged/<name>: EngineArgs' defaults, "models" for this cache and "xla" for
    the compilation cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged", name)


@dataclasses.dataclass(frozen=True)
class CachedModel:
    config: LlamaConfig
    params: Params  # on the default device
    dtype: np.dtype
    tokenizer_dir: Path  # load with jaxpaged.tokenizer.load_hf_tokenizer


def entry_key(gguf_file: Path, dtype: str) -> str:
    stat = gguf_file.stat()
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for part in (str(gguf_file.resolve()), str(stat.st_size), str(stat.st_mtime_ns), dtype,
                 importlib.metadata.version("gguf"), str(FORMAT_VERSION)):
        digest.update(part.encode() + b"\0")
    for builder in _BUILDERS:
        digest.update((package / builder).read_bytes())
    return digest.hexdigest()[:32]


def load(cache_dir: str | Path, gguf_file: Path, dtype: str) -> CachedModel | None:
    """The cached entry for (file, requested dtype), its params put on the device; None if absent or unreadable."""
    from jaxpaged.checkpoint import config_from_dict  # pylint: disable=import-outside-toplevel
    entry = Path(cache_dir) / entry_key(gguf_file, dtype)
    if not (entry / _META).is_file():
        return None
    try:
        meta = json.loads((entry / _META).read_text())
        if meta.get("format") != FORMAT_VERSION:
            return None
        params: Params = {"layers": {}}
        with safe_open(str(entry / _PARAMS), framework="numpy") as f:
            for name in f.keys():  # one tensor on the host at a time
                *outer, leaf = name.split(".")
                (params["layers"] if outer else params)[leaf] = jax.device_put(f.get_tensor(name))
        return CachedModel(config_from_dict(meta["config"]), params, params["embed"].dtype, entry / _TOKENIZER)
    except Exception as err:  # a damaged entry: rebuilt from the GGUF file
        logger.warning("model cache entry %s is unreadable (%s: %s); reading %s instead", entry,
                       type(err).__name__, err, gguf_file)
        return None


def store(cache_dir: str | Path, gguf_file: Path, dtype: str, config: LlamaConfig, params: Params,
          tokenizer) -> Path | None:
    """Write the entry for (file, requested dtype); returns its folder, or None (with a warning) if it
    cannot be written (the model is served all the same)."""
    from jaxpaged.checkpoint import config_to_dict  # pylint: disable=import-outside-toplevel
    cache_dir = Path(cache_dir)
    entry = cache_dir / entry_key(gguf_file, dtype)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))
        try:
            flat = {name: np.asarray(value) for name, value in _flatten(params)}
            save_file(flat, str(tmp / _PARAMS))
            tokenizer.save_pretrained(str(tmp / _TOKENIZER))
            meta = {"format": FORMAT_VERSION, "source": str(gguf_file), "dtype": np.dtype(params["embed"].dtype).name,
                    "config": config_to_dict(config)}
            (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the entry complete
            if entry.exists():  # an unreadable entry being replaced
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:  # also: another start renamed its copy into place first (directory not empty)
        if (entry / _META).is_file():
            return entry
        logger.warning("could not write the model cache entry %s (%s)", entry, err)
        return None
    return entry


def _flatten(params: Params):
    """("embed", array), ("layers.wq", array), ... for the stacked params pytree."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError("the model cache stores stacked layers ({name: [L, ...]}) only")
    for name, value in params.items():
        if name != "layers":
            yield name, value
    for name, value in layers.items():
        yield f"layers.{name}", value


__all__ = ["CachedModel", "default_cache_dir", "entry_key", "load", "store"]
