"""worker/step_input.py: a step's host arrays packed into one buffer and rebuilt inside a program."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.step_input import empty_step, pack_host_inputs, unpack_host_inputs


def _tree():
    step = empty_step(8, 4, 3)
    step = step.__class__(**{**step.__dict__, "token_ids": np.arange(8, dtype=np.int32) - 3,
                             "page_table": np.arange(12, dtype=np.int32).reshape(4, 3)[:, ::-1],  # not contiguous
                             "num_seqs": np.int32(3)})
    batch = make_sampling_batch([RowInfo(SamplingParams(temperature=0.7, top_p=0.9, seed=1), seed=2**40 + 5, step=7),
                                 RowInfo(SamplingParams(temperature=0.0), seed=3)], 4, 64)
    device = jnp.arange(5, dtype=jnp.int32)
    odd = np.array([np.nan, -0.0, np.inf, 1e-42], np.float32)  # bits a float cast would change: NaN, -0, subnormal
    return (step, batch, {"device": device, "odd": odd, "wide": np.uint32([0xFFFFFFFF, 1]),
                          "bytes": np.ones((2, 3), np.bool_)})


def _bits(x):
    x = np.asarray(x)
    return x.view(np.int32) if x.dtype.itemsize == 4 else x


def test_unpacked_tree_equals_the_host_tree_bit_for_bit():
    tree = _tree()
    layout, buffer, others = pack_host_inputs(tree)
    host_leaves = jax.tree_util.tree_leaves(tree)
    packed = [x for x in host_leaves if isinstance(x, (np.ndarray, np.generic)) and x.dtype.itemsize == 4]
    assert buffer.dtype == np.int32 and buffer.size == sum(x.size for x in packed)
    # the bool array and the device array are passed as they are, in order
    assert len(others) == 2 and others[0] is tree[2]["bytes"] and others[1] is tree[2]["device"]
    rebuilt = jax.jit(unpack_host_inputs, static_argnums=0)(layout, buffer, others)
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(tree)
    for want, got in zip(host_leaves, jax.tree_util.tree_leaves(rebuilt)):
        assert np.shape(got) == np.shape(want) and np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_compiled_layout_decides_what_is_packed():
    """`like`: a leaf the program took as it is stays so even when it is a host array now (penalty counts: device
    neutral at warm-up, a host array in a step with penalties); a leaf it packed that is a device array now makes
    another layout (the runner then compiles one rather than misread the buffer)."""
    step = empty_step(8, 4, 3)
    counts_device = {"counts": jnp.zeros((4, 6), jnp.int32), "temperature": np.zeros(4, np.float32)}
    warm, _, _ = pack_host_inputs((step, counts_device))
    counts_host = {"counts": np.ones((4, 6), np.int32), "temperature": np.full(4, 0.5, np.float32)}
    layout, buffer, others = pack_host_inputs((step, counts_host), warm)
    assert layout == warm and len(others) == 1 and others[0] is counts_host["counts"]
    assert buffer.size == sum(x.size for x in jax.tree_util.tree_leaves(step)) + 4
    temperature_device = {"counts": jnp.zeros((4, 6), jnp.int32), "temperature": jnp.zeros(4, jnp.float32)}
    assert pack_host_inputs((step, temperature_device), warm)[0] != warm
    assert pack_host_inputs((step, counts_device), warm)[0] == warm
