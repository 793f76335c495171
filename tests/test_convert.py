"""Orbax checkpoints: convert, restore (one device and sharded at another tp), identical logits."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import checkpoint
from jaxpaged.convert import main as convert_main
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.llama import forward_jit
from jaxpaged.models.loader import load_model
from tests.parallel_worker import ENGINE, prefill_logits
from tests.test_parallel import PROMPTS, run_worker

TOKENS = jnp.asarray([[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]])


@pytest.fixture(scope="module")
def source(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["gqa8"]), dtype="float32")


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "gqa8"
    convert_main(["--model", str(tiny_checkpoints["gqa8"]), "--out", str(out)])
    return out


def assert_same_params(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_convert_writes_a_loadable_folder(converted, source):
    assert checkpoint.is_checkpoint(converted)
    meta = json.loads((converted / checkpoint.CONFIG_FILE).read_text())
    assert meta["dtype"] == "float32" and meta["config"]["num_key_value_heads"] == 4
    assert (converted / "tokenizer.json").is_file() and (converted / "generation_config.json").is_file()
    restored = load_model(str(converted))
    assert restored.config == source.config and restored.dtype == np.float32
    assert_same_params(restored.params, source.params)
    assert restored.generation_config == source.generation_config
    text = "<|user|>hi<|eos|>"
    assert restored.tokenizer(text)["input_ids"] == source.tokenizer(text)["input_ids"]
    assert restored.tokenizer.chat_template == source.tokenizer.chat_template
    np.testing.assert_array_equal(forward_jit(restored.config, restored.params, TOKENS),
                                  forward_jit(source.config, source.params, TOKENS))


def test_restore_casts_dtype(converted, source):
    restored = load_model(str(converted), dtype="bfloat16")
    assert restored.dtype == jnp.bfloat16 and restored.params["layers"]["wq"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                  np.asarray(source.params["embed"].astype(jnp.bfloat16)))


def test_config_round_trip_with_rope_scaling(tiny_checkpoints):
    config = load_model(str(tiny_checkpoints["llama3_rope"]), dtype="float32").config
    assert checkpoint.config_from_dict(json.loads(json.dumps(checkpoint.config_to_dict(config)))) == config


def test_sharded_restore_at_other_tp_and_save_from_shards(converted, source, tmp_path):
    """Saved from one device, restored straight into tp = 2 and 4 shardings; saved back from tp=4 shards."""
    engine = LLMEngine(EngineArgs(model="unused", dtype="float32", **ENGINE), loaded=source)
    expected = prefill_logits(engine, list(range(3, 33)))
    resaved = tmp_path / "from-tp4"
    result = run_worker("serve", {"model": str(converted), "checkpoint": True, "tps": [1, 2, 4],
                                  "prompts": PROMPTS, "max_tokens": 8, "save_to": str(resaved),
                                  # the runner's params are saved: keep the checkpoint layout
                                  "engine_args": {"fuse_projections": False, "weight_layout": "stacked"}})
    np.testing.assert_array_equal(result["1"]["logits"], expected)
    for tp in ("2", "4"):
        assert result[tp]["tokens"] == result["1"]["tokens"]
        np.testing.assert_allclose(result[tp]["logits"], expected, atol=1e-4, rtol=0)
        wq = result[tp]["shards"]["['layers']['wq']"]
        assert wq["device_bytes"] == [wq["bytes"] // int(tp)] * int(tp)
    assert_same_params(load_model(str(resaved)).params, source.params)


@pytest.mark.slow
def test_load_times_smollm2(smollm2_path, tmp_path):
    """Load SmolLM2 (bf16) from GGUF, safetensors and Orbax; prints the seconds (docs/performance.md)."""
    import torch
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    gguf = load_model(str(smollm2_path), dtype="bfloat16")
    c = gguf.config  # same shapes in safetensors (random values: the load time does not depend on them)
    hf = LlamaForCausalLM(HFLlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "safetensors")
    gguf.tokenizer.save_pretrained(tmp_path / "safetensors")
    convert_main(["--model", str(smollm2_path), "--out", str(tmp_path / "orbax"), "--dtype", "bfloat16"])
    times = {}
    for name, path in [("gguf", smollm2_path), ("safetensors", tmp_path / "safetensors"),
                       ("orbax", tmp_path / "orbax")]:
        best = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(load_model(str(path), dtype="bfloat16").params)
            best.append(time.perf_counter() - start)
        times[name] = min(best)
    print("\nSmolLM2-135M bf16 load_model seconds (best of 3):", json.dumps(times))
    orbax = load_model(str(tmp_path / "orbax"), dtype="bfloat16")
    assert orbax.config == gguf.config
    assert_same_params(orbax.params, gguf.params)
