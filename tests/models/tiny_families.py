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
