"""Convert any loadable model to a jaxpaged (Orbax) checkpoint folder (docs/distributed.md, "Orbax checkpoints").

    python -m jaxpaged.convert --model <HF id | folder | .gguf | built-in name> --out <dir> [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxpaged import checkpoint
from jaxpaged.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from jaxpaged.tokenizer import GenerationConfig


def generation_config_dict(gen: GenerationConfig) -> dict:
    """Hugging Face generation_config.json fields that `load_generation_config` reads back."""
    data: dict = dict(gen.defaults)
    if gen.eos_token_ids:
        data["eos_token_id"] = list(gen.eos_token_ids)
    if gen.bos_token_id is not None:
        data["bos_token_id"] = gen.bos_token_id
    return data


def save_model(loaded: LoadedModel, out: Path) -> Path:
    """Write params + jaxpaged_config.json + tokenizer + generation config into `out`."""
    out = Path(out)
    checkpoint.save_params(out, loaded.config, loaded.params)
    loaded.tokenizer.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps(generation_config_dict(loaded.generation_config), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxpaged.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF repo id, folder, .gguf or built-in name")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--dtype", default="auto", help="auto (the source's), bfloat16, float16, float32")
    parser.add_argument("--revision", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    save_model(load_model(args.model, dtype=args.dtype, revision=args.revision), args.out)
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
