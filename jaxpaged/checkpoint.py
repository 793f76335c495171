"""jaxpaged checkpoints: the params pytree in Orbax, restored straight into its shardings.

The folder `python -m jaxpaged.convert` writes, and why a restore targets the shardings (each device reads only
its own shards, nothing assembled in full on one host; Orbax casts to the dtype asked): docs/distributed.md,
"Orbax checkpoints".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jaxpaged.worker import parallel
from jaxpaged.models.llama import Llama3RopeScaling, LlamaConfig, Params
from jaxpaged.models.params import param_shapes

CONFIG_FILE = "jaxpaged_config.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)  # rope_scaling becomes a dict, tuples become lists in JSON


def config_from_dict(data: dict[str, Any]) -> LlamaConfig:
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = Llama3RopeScaling(**data["rope_scaling"])
    for key, value in data.items():  # JSON lists back to the config's tuples (eos ids, per-layer fields)
        if isinstance(value, list):
            data[key] = tuple(value)
    return LlamaConfig(**data)


def read_checkpoint_meta(path: Path) -> tuple[LlamaConfig, np.dtype]:
    """The model config and the saved dtype, from jaxpaged_config.json."""
    meta = json.loads((path / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path / CONFIG_FILE}: format {meta.get('format')!r}, this jaxpaged reads "
                         f"{FORMAT_VERSION}")
    return config_from_dict(meta["config"]), np.dtype(jnp.dtype(meta["dtype"]))  # jnp's names: bfloat16 too


@contextlib.contextmanager
def _orbax():
    """orbax.checkpoint, imported on first use (it costs ~1 s), without it configuring the root logger.

    Orbax logs through absl, whose first log call runs `logging.basicConfig()` when the
    root logger has no handler: a library must leave that to the application (it would
    also make the server's own `basicConfig` a no-op). A NullHandler on the root while
    Orbax runs stops that; it is removed again after.
    """
    root, guard = logging.getLogger(), logging.NullHandler()
    unconfigured = not root.handlers
    if unconfigured:
        root.addHandler(guard)
    try:
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
        yield ocp
    finally:
        if unconfigured:
            root.removeHandler(guard)


def save_params(path: Path, config: LlamaConfig, params: Params) -> None:
    """Write params (Orbax) and jaxpaged_config.json into the folder `path` (created)."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    dtype = params["embed"].dtype
    with _orbax() as ocp, ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, params, force=True)
    meta = {"format": FORMAT_VERSION, "dtype": np.dtype(dtype).name, "config": config_to_dict(config)}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def abstract_params(config: LlamaConfig, dtype, mesh: Mesh | None) -> Params:
    """ShapeDtypeStructs of the params with their target shardings (one device without a mesh)."""
    shapes = param_shapes(config)
    is_shape = lambda s: isinstance(s, tuple)  # noqa: E731
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype, sharding=device), shapes, is_leaf=is_shape)
    shardings = parallel.param_shardings(config, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh), shapes, shardings,
                        is_leaf=is_shape)


def restore_params(path: Path, config: LlamaConfig, dtype, mesh: Mesh | None = None) -> Params:
    """Read the params straight into their shardings on `mesh` (or onto one device)."""
    target = abstract_params(config, dtype, mesh)
    with _orbax() as ocp, ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(path).absolute() / PARAMS_DIR, target)


__all__ = ["CONFIG_FILE", "abstract_params", "is_checkpoint", "read_checkpoint_meta", "restore_params",
           "save_params"]
