"""Model name resolution: built-in short name, local paths, the Hugging Face cache layout."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from jaxpaged.models.loader import DEFAULT_MODEL, ModelNotFoundError, load_model, resolve_model_path

REV = "0123456789abcdef0123456789abcdef01234567"


def _fake_hf_cache(home, repo_id, checkpoint):
    cache = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = cache / "snapshots" / REV
    shutil.copytree(checkpoint, snapshot)
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HOME in tmp_path, no network: the hub's cache layout is all resolve_model_path may read."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_default_model_resolves_to_shipped_gguf():
    path = resolve_model_path(DEFAULT_MODEL)
    assert path.suffix == ".gguf" and path.is_file()
    assert resolve_model_path("SmolLM2-135M-Instruct") == path


def test_repo_id_loads_from_hf_cache_offline(offline_hub, tiny_checkpoints):
    snapshot = _fake_hf_cache(offline_hub, "acme/tiny-llama", tiny_checkpoints["gqa4"])
    assert resolve_model_path("acme/tiny-llama") == snapshot
    loaded = load_model("acme/tiny-llama")
    assert loaded.config.num_key_value_heads == 2 and loaded.source == snapshot


def test_missing_repo_offline_says_where_it_looked(offline_hub):
    with pytest.raises(ModelNotFoundError, match=f"looked in {offline_hub / 'hub'}"):
        resolve_model_path("acme/not-there")


def test_nonsense_name_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="not a built-in model"):
        resolve_model_path("./no/such/dir")


def test_safetensors_path_runs_without_the_gguf_package(tiny_checkpoints):
    """The GPU image has no `gguf`: only GGUF files may need it."""
    code = ("import sys\n"
            "sys.modules['gguf'] = None  # any `import gguf` now raises ImportError\n"
            "from jaxpaged import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_checkpoints['gqa4'])!r}, max_model_len=64, max_num_seqs=2,\n"
            "          max_num_batched_tokens=16)\n"
            "out = llm.generate(['Hi'], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)\n"
            "assert len(out[0].outputs[0].token_ids) == 2\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_meta_llama_3_short_ids_resolve_to_their_hub_repos(offline_hub, tiny_checkpoints):
    snapshot = _fake_hf_cache(offline_hub, "meta-llama/Meta-Llama-3-8B-Instruct", tiny_checkpoints["gqa4"])
    assert resolve_model_path("meta-llama/Llama-3-8B-Instruct") == snapshot
    assert resolve_model_path("meta-llama/Meta-Llama-3-8B-Instruct") == snapshot
    with pytest.raises(ModelNotFoundError, match="'meta-llama/Meta-Llama-3-8B' is not in the Hugging Face cache"):
        resolve_model_path("meta-llama/Llama-3-8B")
