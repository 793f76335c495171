"""Shared fixtures: tiny random Llama checkpoints, the built-in SmolLM2, a compilation cache."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import jax
import pytest

# A persistent XLA compilation cache shared by test runs (and by the server's default location).
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged", "xla-tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
    """A script under benchmarks/, scripts/ or examples/ imported as a module, the way `python <path>` runs it: its folder
    on sys.path (the entry points import their siblings by name) and the module registered under its file's
    name (dataclasses look their module up there). Loaded once: a second call returns the same module."""
    path = ROOT / relative_path
    if not path.is_file():
        raise FileNotFoundError(f"no script {relative_path} under {ROOT}")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    loaded = sys.modules.get(path.stem)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(path.stem, None)
        raise
    return module


TINY_SPECIALS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]  # ids 256.. after the 256 bytes
TINY_BASE = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                 rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=256, eos_token_id=257)
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")

TINY_VARIANTS = {
    "mha": {},
    "gqa4": dict(num_attention_heads=8, num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "llama3_rope": dict(rope_theta=500000.0, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gqa8": dict(num_attention_heads=8, num_key_value_heads=4),  # tensor parallel 1/2/4 (tests/test_parallel.py)
}


def make_tiny_checkpoint(folder: Path, variant: str = "gqa4", seed: int = 0, **save_kwargs) -> Path:
    """A random LlamaForCausalLM saved with `save_pretrained` (safetensors, float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_BASE, **TINY_VARIANTS[variant]})
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms away from 1 so a wrong norm weight shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_tokenizer():
    """Byte-level tokenizer: ids 0..255 are the bytes, then TINY_SPECIALS; no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), sorted(alphabet, key=lambda c: _byte_of(c)))}
    backend = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>",
                                   chat_template=TINY_CHAT_TEMPLATE)


def _byte_of(char: str) -> int:
    """GPT-2's byte -> printable char map, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    return table[char]


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs.

    Every XLA:CPU executable holds its own memory mappings, and jitted functions
    (the kernels' public entry points among them) keep every executable they ever
    compiled. Kept for the whole run, they reach the kernel's vm.max_map_count
    (65530 here) and LLVM's JIT aborts ("Unable to allocate section memory").
    Live engines keep working: a dropped program recompiles from the persistent cache.
    """
    yield
    jax.clear_caches()


# A tiny-model engine's warm-up maps ~1,900 regions (2026-11-30), and a module's tests can make dozens.
_MAX_MAPPINGS_BEFORE_A_TEST = 40_000


@pytest.fixture(autouse=True)
def _drop_compiled_programs_near_the_map_limit():
    """Before a test, drop JAX's compiled-program caches (as after each module, above) when the process
    already holds _MAX_MAPPINGS_BEFORE_A_TEST memory mappings, so one module's engines cannot reach
    vm.max_map_count either. Free below that: one read of /proc/self/maps (absent off Linux: no-op)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = sum(1 for _ in maps)
    except OSError:
        count = 0
    if count > _MAX_MAPPINGS_BEFORE_A_TEST:
        gc.collect()
        jax.clear_caches()
        gc.collect()
    yield


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_checkpoint(root / v, v, seed=i) for i, v in enumerate(TINY_VARIANTS)}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from jaxpaged.models.loader import DEFAULT_MODEL, resolve_model_path
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The built-in default model, loaded once (float32)."""
    from jaxpaged.models.loader import load_model
    return load_model(str(smollm2_path), dtype="float32")


def _llama_cpp_permute(w, n_heads: int):
    """llama.cpp's converter permutation of Q/K rows (what our loader must undo)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(checkpoint: Path, out: Path, qtype_name: str = "F32", arch: str = "llama") -> Path:
    """Write a tiny HF checkpoint as a llama.cpp-style GGUF (2-D weights in `qtype_name`)."""
    import json

    import gguf
    import numpy as np
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    hf = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hf["hidden_size"] // heads)
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    tok = tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in TINY_SPECIALS else 1 for t, _ in vocab])
    writer.add_token_merges([])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, w in tensors.items():
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            gguf_name = f"blk.{i}.{layer_names['.'.join(rest[:-1])]}.weight"
        else:
            gguf_name = names[name]
        if gguf_name.endswith("attn_q.weight"):
            w = _llama_cpp_permute(w, heads)
        elif gguf_name.endswith("attn_k.weight"):
            w = _llama_cpp_permute(w, kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
