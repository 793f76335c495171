"""Tiny random checkpoints of every registered family, saved with transformers' `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TINY_BASE, tiny_tokenizer

_BASE = {k: v for k, v in TINY_BASE.items() if k != "rope_theta"}

# name -> (transformers config class, model class, config overrides)
FAMILY_VARIANTS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # A window (5) shorter than the test prompts, on every layer.
    "mistral_window": ("MistralConfig", "MistralForCausalLM",
                       dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5)),
    # Local (window 4, RoPE base 10k) and global (RoPE base 1M) layers, query_pre_attn_scalar != head_dim.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=4, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                    pad_token_id=0)),
}


def make_family_checkpoint(folder: Path, variant: str, seed: int = 0) -> Path:
    """A random checkpoint of `variant` (float32), norms and biases away from their init values."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILY_VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if "gemma" in variant else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def load_hf_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def make_family_gguf(checkpoint: Path, out: Path, arch: str) -> Path:
    """Write a tiny qwen2/qwen3 checkpoint as a llama.cpp-style F32 GGUF (no Q/K permutation: llama.cpp
    permutes only the llama arch), byte-level tokenizer with the `qwen2` pre-tokenizer."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from jaxpaged.models.registry import GGUF_LAYER_NAMES, family
    from tests.conftest import TINY_CHAT_TEMPLATE, TINY_SPECIALS

    hf = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    vocab = sorted(tiny_tokenizer().get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in TINY_SPECIALS else 1 for t, _ in vocab])
    writer.add_token_merges([])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    hf_to_gguf = {suffix: GGUF_LAYER_NAMES[key] for key, suffix in family(arch).hf_layer_names.items()}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, w in load_file(str(checkpoint / "model.safetensors")).items():
        if name.startswith("model.layers."):
            i, suffix = name.split(".", 3)[2], name.split(".", 3)[3]
            name = f"blk.{i}.{hf_to_gguf[suffix]}"
        else:
            name = top[name]
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
