"""Safetensors loading: sharded == single file, dtypes, and damaged checkpoints."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from jaxpaged.models.loader import load_model, parse_dtype
from jaxpaged.models.weights import WeightLoadError
from tests.conftest import make_tiny_checkpoint


def test_sharded_loads_same_params_as_single_file(tmp_path):
    single = make_tiny_checkpoint(tmp_path / "single", "gqa4", seed=3)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "gqa4", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = load_model(str(single)).params
    b = load_model(str(sharded)).params
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype, expected", [("auto", np.float32), ("bfloat16", jax.numpy.bfloat16),
                                             ("float16", np.float16), ("float32", np.float32)])
def test_dtype_choice(tiny_checkpoints, dtype, expected):
    loaded = load_model(str(tiny_checkpoints["tied"]), dtype=dtype)
    assert {leaf.dtype for leaf in jax.tree.leaves(loaded.params)} == {np.dtype(expected)}


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype='int8'"):
        parse_dtype("int8")


def test_truncated_safetensors_is_a_clear_error(tmp_path, tiny_checkpoints):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["mha"], folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load_model(str(folder))


def test_missing_shard_is_a_clear_error(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "sharded", "mha", max_shard_size="40KB")
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(WeightLoadError, match="missing"):
        load_model(str(folder))


def test_auto_dtype_falls_back_to_stored_tensors(tmp_path):
    """No dtype in config.json: 'auto' takes the dtype the tensors are stored in (read from the header)."""
    import json

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from jaxpaged.models.weights import checkpoint_dtype

    folder = make_tiny_checkpoint(tmp_path / "bf16", "mha")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    hf = json.loads((folder / "config.json").read_text())
    hf.pop("dtype", None), hf.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(hf))
    assert checkpoint_dtype(folder) == np.dtype(ml_dtypes.bfloat16)
    loaded = load_model(str(folder))
    assert {leaf.dtype for leaf in jax.tree.leaves(loaded.params)} == {np.dtype(ml_dtypes.bfloat16)}
