"""The GGUF model cache: a second load reads the cached entry (never the GGUF file) and gets the same model."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxpaged.models import gguf_loader, model_cache
from jaxpaged.models.loader import load_model
from tests.conftest import make_tiny_gguf


@pytest.fixture
def tiny_gguf(tmp_path, tiny_checkpoints):
    return make_tiny_gguf(tiny_checkpoints["gqa4"], tmp_path / "tiny.gguf", "Q8_0")


def _no_gguf_reads(monkeypatch):
    def refuse(path):
        raise AssertionError(f"the GGUF file {path} was opened although the cache holds it")
    monkeypatch.setattr(gguf_loader, "open_gguf", refuse)


def assert_same_model(a, b):
    assert a.config == b.config and a.dtype == b.dtype
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    text = "<|user|>hi there<|eos|> 1234"
    assert a.tokenizer(text)["input_ids"] == b.tokenizer(text)["input_ids"]
    assert a.tokenizer.chat_template == b.tokenizer.chat_template
    assert (a.tokenizer.bos_token, a.tokenizer.eos_token) == (b.tokenizer.bos_token, b.tokenizer.eos_token)
    assert a.generation_config == b.generation_config


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_second_load_reads_the_cache_not_the_gguf(tiny_gguf, tmp_path, monkeypatch, dtype):
    cache = tmp_path / "cache"
    first = load_model(str(tiny_gguf), dtype=dtype, cache_dir=str(cache))
    assert len(list(cache.iterdir())) == 1
    _no_gguf_reads(monkeypatch)
    second = load_model(str(tiny_gguf), dtype=dtype, cache_dir=str(cache))
    assert_same_model(first, second)
    assert second.dtype == (np.float32 if dtype == "auto" else jax.numpy.bfloat16)


def test_chat_template_override_is_not_cached(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    custom = load_model(str(tiny_gguf), cache_dir=str(cache), chat_template="{{ messages[0]['content'] }}")
    assert custom.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    plain = load_model(str(tiny_gguf), cache_dir=str(cache))
    assert plain.tokenizer.chat_template == load_model(str(tiny_gguf)).tokenizer.chat_template


def test_a_changed_file_or_dtype_misses(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    load_model(str(tiny_gguf), cache_dir=str(cache))
    key = model_cache.entry_key(tiny_gguf, "auto")
    assert model_cache.entry_key(tiny_gguf, "float16") != key
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten (same size)
    assert model_cache.entry_key(tiny_gguf, "auto") != key
    assert model_cache.load(cache, tiny_gguf, "auto") is None
    _no_gguf_reads(monkeypatch)
    with pytest.raises(AssertionError, match="was opened"):
        load_model(str(tiny_gguf), cache_dir=str(cache))


def test_a_damaged_entry_is_rebuilt(tiny_gguf, tmp_path, caplog):
    cache = tmp_path / "cache"
    first = load_model(str(tiny_gguf), cache_dir=str(cache))
    entry = cache / model_cache.entry_key(tiny_gguf, "auto")
    (entry / "params.safetensors").write_bytes(b"not safetensors")
    again = load_model(str(tiny_gguf), cache_dir=str(cache))
    assert "unreadable" in caplog.text
    assert_same_model(first, again)
    assert model_cache.load(cache, tiny_gguf, "auto") is not None  # rewritten


def test_an_unwritable_cache_still_loads(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    loaded = load_model(str(tiny_gguf), cache_dir=str(blocker / "cache"))
    assert loaded.config.num_hidden_layers == 2
    assert "could not write the model cache entry" in caplog.text
