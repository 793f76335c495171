"""Every registered family against transformers: config parsing, logits (f32, 1e-4), greedy generation."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from jaxpaged.models.llama import LlamaConfig, UnsupportedModelError, forward_jit
from jaxpaged.models.loader import load_model
from tests.models.tiny_families import FAMILY_VARIANTS, load_hf_model, make_family_checkpoint


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {v: make_family_checkpoint(root / v, v) for v in FAMILY_VARIANTS}


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS))
def test_logits_match_transformers(family_checkpoints, variant):
    import torch
    folder = family_checkpoints[variant]
    loaded = load_model(str(folder), dtype="float32")
    token_ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=24).tolist()
    ours = np.asarray(forward_jit(loaded.config, loaded.params, jnp.asarray([token_ids]))[0])
    with torch.no_grad():
        theirs = load_hf_model(folder)(torch.tensor([token_ids])).logits[0].numpy()
    assert ours.shape == theirs.shape == (24, loaded.config.vocab_size)
    assert np.abs(ours - theirs).max() <= 1e-4


def test_family_fields(family_checkpoints):
    cfg = {v: load_model(str(f)).config for v, f in family_checkpoints.items()}
    assert cfg["qwen2"].architecture == "qwen2" and cfg["qwen2"].attention_bias and not cfg["qwen2"].qk_norm
    assert cfg["qwen3"].qk_norm and not cfg["qwen3"].attention_bias and cfg["qwen3"].head_dim == 32
    assert cfg["mistral"].sliding_window is None and not cfg["mistral"].has_sliding_window
    assert cfg["mistral_window"].sliding_window == 5 and cfg["mistral_window"].all_layers_windowed
    g = cfg["gemma3"]
    assert g.windowed_layers == (True, False, True) and not g.all_layers_windowed
    assert (g.rope_theta, g.local_rope_theta, g.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert g.norm_weight_offset == 1.0 and g.scale_embeddings and g.sandwich_norms and g.hidden_act == "gelu_tanh"
    assert g.tie_word_embeddings


def _hf(arch, model_type, **kw):
    return dict(architectures=[arch], model_type=model_type, vocab_size=32, hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2, **kw)


@pytest.mark.parametrize("hf, match", [
    (_hf("Gemma3ForCausalLM", "gemma3_text", final_logit_softcapping=30.0), "final_logit_softcapping"),
    (_hf("Gemma3ForCausalLM", "gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_hf("Gemma3ForCausalLM", "gemma3_text", sliding_window=4, layer_types=["chunked_attention"] * 2),
     "chunked_attention"),
    (_hf("MistralForCausalLM", "mistral", attention_bias=True), "attention_bias"),
    (_hf("Gemma2ForCausalLM", "gemma2"), "Gemma2ForCausalLM.*supports LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM"),
    (_hf("LlamaForCausalLM", "llama", hidden_act="relu"), "hidden_act"),
])
def test_unsupported_configs_are_clear_errors(hf, match):
    with pytest.raises(UnsupportedModelError, match=match):
        LlamaConfig.from_hf_dict(hf)


def test_gemma3_old_style_pattern_and_qwen_window_flag():
    g = LlamaConfig.from_hf_dict(_hf("Gemma3ForCausalLM", "gemma3_text", num_key_value_heads=1, sliding_window=8,
                                     sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4))
    assert g.windowed_layers == (True, False) and g.local_rope_theta == 1e4 and g.rope_theta == 1e6
    off = LlamaConfig.from_hf_dict(_hf("Qwen2ForCausalLM", "qwen2", sliding_window=8, use_sliding_window=False))
    assert not off.has_sliding_window
    on = LlamaConfig.from_hf_dict(_hf("Qwen2ForCausalLM", "qwen2", sliding_window=8, use_sliding_window=True,
                                      layer_types=["full_attention", "sliding_attention"]))
    assert on.windowed_layers == (False, True)


GEN_ARGS = dict(dtype="float32", seed=0, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                num_pages=64, block_size=8, warmup=False)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch
    model.generation_config.eos_token_id = None  # run the full n tokens, as ignore_eos does
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS))
def test_engine_greedy_batch_equals_transformers_generate(family_checkpoints, variant):
    """Mixed lengths (1 to 30 tokens, longer than the windows of 4 and 5), chunked prefill (16 tokens a
    step), pages of 8 tokens: the engine's greedy batch equals transformers' generate, prompt by prompt."""
    from jaxpaged import LLM, SamplingParams
    folder = family_checkpoints[variant]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 13, 30, 6, 21)]
    llm = LLM(model=str(folder), **GEN_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = load_hf_model(folder)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 12), (variant, len(prompt))


@pytest.mark.parametrize("variant", ["qwen2", "gemma3"])
def test_tensor_parallel_2_matches_1(family_checkpoints, variant):
    """Biases shard with their heads (Qwen2); q/k and sandwich norms replicate, windows per layer (Gemma 3)."""
    from tests.test_parallel import run_worker
    prompts = [[1, 2, 3, 4, 5], list(range(40, 60))]
    result = run_worker("serve", {"model": str(family_checkpoints[variant]), "tps": [1, 2], "prompts": prompts,
                                  "max_tokens": 8}, devices=2)
    assert result["2"]["tokens"] == result["1"]["tokens"]
    np.testing.assert_allclose(result["2"]["logits"], result["1"]["logits"], atol=1e-4, rtol=0)
    shards = result["2"]["shards"]
    for name in (["bq", "bk", "bv"] if variant == "qwen2" else ["q_norm", "post_mlp_norm"]):
        leaf = shards[f"['layers'][0]['{name}']"]  # per-layer weights (the CPU default): layer 0
        expected = [leaf["bytes"] // 2] * 2 if name.startswith("b") else [leaf["bytes"]] * 2
        assert leaf["device_bytes"] == expected, name


@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
def test_orbax_conversion_round_trip(family_checkpoints, variant, tmp_path):
    from jaxpaged.convert import save_model
    loaded = load_model(str(family_checkpoints[variant]), dtype="float32")
    restored = load_model(str(save_model(loaded, tmp_path / "ckpt")))
    assert restored.config == loaded.config
    tokens = jnp.asarray([list(range(3, 20))])
    np.testing.assert_array_equal(np.asarray(forward_jit(restored.config, restored.params, tokens)),
                                  np.asarray(forward_jit(loaded.config, loaded.params, tokens)))


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_gguf_of_the_family_matches_transformers(family_checkpoints, variant, tmp_path):
    """llama.cpp-style F32 qwen2/qwen3 GGUF files (biases, q/k norms, explicit head_dim, no Q/K
    permutation) against transformers on the checkpoint they were written from (its GGUF reader
    misses qwen3's head_dim); the qwen2 pre-tokenizer splits digits one by one."""
    import torch
    from tests.models.tiny_families import make_family_gguf
    path = make_family_gguf(family_checkpoints[variant], tmp_path / f"{variant}.gguf", variant)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.architecture == variant
    token_ids = np.random.default_rng(2).integers(0, 256, size=20).tolist()
    ours = np.asarray(forward_jit(loaded.config, loaded.params, jnp.asarray([token_ids]))[0])
    with torch.no_grad():
        theirs = load_hf_model(family_checkpoints[variant])(torch.tensor([token_ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4
    tok = loaded.tokenizer
    assert tok.decode(tok("abc 12345 def")["input_ids"]) == "abc 12345 def"
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab 123")]
    assert pieces == ["ab", "\u0120", "1", "2", "3"]  # Llama 3's split would keep "123" whole


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_mixed_window_paged_step_lowers_for_cuda(backend):
    """The Gemma 3 shaped paged step (per-layer windows and RoPE bases scanned) lowers for the GPU
    from this CPU, with the Triton kernel or the XLA path."""
    import jax
    from jaxpaged.worker.runner_config import AttentionConfig
    from jaxpaged.worker.step_input import KVPool, StepInput
    from jaxpaged.worker.step_program import paged_forward
    from jaxpaged.models.params import param_shapes
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, architecture="gemma3",
                         qk_norm=True, norm_weight_offset=1.0, scale_embeddings=True, hidden_act="gelu_tanh",
                         sandwich_norms=True, query_pre_attn_scalar=64.0, sliding_window=32,
                         layer_windowed=(True, False, True), local_rope_theta=1e4, tie_word_embeddings=True)
    sds = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda s: sds(s, jnp.bfloat16), param_shapes(config),
                          is_leaf=lambda s: isinstance(s, tuple))
    pool = sds((3, 1, 64, 16, 64), jnp.bfloat16)
    t, s, p = 32, 4, 8
    i32 = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
    step = StepInput(i32(t), i32(t), i32(t), i32(s, p), i32(s), i32(s + 1), i32(), i32(s))
    lowered = jax.jit(paged_forward, static_argnums=(0, 1)).trace(
        config, AttentionConfig(backend, max_num_partial_prefills=2), params, KVPool(pool, pool), step
    ).lower(lowering_platforms=("cuda",))
    assert lowered.as_text()
