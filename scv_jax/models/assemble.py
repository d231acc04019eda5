"""Building a ``Transformer`` from tensors read one at a time (checkpoint loaders share this).

No random initialisation runs and no whole-model copy is made: the model's structure comes from
``nnx.eval_shape``, each stacked ``[num_layers, ...]`` parameter is allocated once in the config's
dtype and filled in place layer by layer, so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scv_jax.models.config import TransformerConfig
from scv_jax.models.transformer import Transformer

LAYER_PREFIX = "blocks/"

# read(name, layer) -> (array in the model's layout, a description of its source for error messages).
# name: a parameter path such as "blocks/attn/q/kernel" or "embed/embedding"; layer: the layer index
# for parameters under LAYER_PREFIX (stacked), else None.
TensorReader = Callable[[str, int | None], tuple[np.ndarray, str]]


def parameter_shapes(config: TransformerConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """{parameter path: shape and dtype} of ``Transformer(config)``; stacked ones lead with [layers]."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return {"/".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, layer: jax.Array, value: jax.Array) -> jax.Array:
    return stacked.at[layer].set(value.astype(stacked.dtype))


def _checked(value, where: str, shape: tuple[int, ...]):
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, the config needs {tuple(shape)}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"{where} has dtype {value.dtype}, expected a floating-point tensor")
    return value


def assemble_transformer(config: TransformerConfig, read: TensorReader) -> Transformer:
    """A ``Transformer(config)`` whose parameters are ``read`` (cast to ``config.dtype``).

    Raises ValueError naming the tensor when one has the wrong shape or is not floating point.
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    for path, var in nnx.to_flat_state(state):
        name = "/".join(map(str, path))
        spec = var.get_value()
        if name.startswith(LAYER_PREFIX):
            value = jnp.zeros(spec.shape, spec.dtype)
            for layer in range(spec.shape[0]):
                tensor = _checked(*read(name, layer), spec.shape[1:])
                value = _set_layer(value, jnp.int32(layer), tensor)
        else:
            value = jnp.asarray(_checked(*read(name, None), spec.shape)).astype(spec.dtype)
        var.set_value(value)
    return nnx.merge(graphdef, state)
