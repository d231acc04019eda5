"""Saving and loading transformer weights as ``.npz`` files with their config.

On disk every layer has its own arrays (``blocks/{i}/attn/q/kernel``, ...), whatever the in-memory
layout; ``load_model`` stacks them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from flax import nnx

from scv_jax.models.assemble import LAYER_PREFIX, assemble_transformer, parameter_shapes
from scv_jax.models.config import TransformerConfig
from scv_jax.models.eagle3 import Eagle3Head, load_eagle3
from scv_jax.models.transformer import Transformer

DEMO_WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "demo" / "weights"
_CONFIG_KEY = "__config__"


def _file_key(name: str, layer: int | None) -> str:
    """The array name on disk of parameter ``name`` (of ``layer`` for stacked parameters)."""
    return name if layer is None else f"{LAYER_PREFIX}{layer}/{name[len(LAYER_PREFIX):]}"


def _file_keys(config: TransformerConfig) -> set[str]:
    return {_file_key(name, layer)
            for name in parameter_shapes(config)
            for layer in (range(config.num_layers) if name.startswith(LAYER_PREFIX) else [None])}


def save_model(model: Transformer, path: str | pathlib.Path, dtype=np.float16) -> None:
    """Writes the parameters (cast to ``dtype``) and the config to one ``.npz`` file."""
    arrays = {}
    for path_, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = "/".join(map(str, path_)), np.asarray(var.get_value(), dtype)
        if name.startswith(LAYER_PREFIX):
            arrays.update({_file_key(name, layer): value[layer] for layer in range(value.shape[0])})
        else:
            arrays[name] = value
    arrays[_CONFIG_KEY] = np.frombuffer(json.dumps(model.config.to_dict()).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_model(path: str | pathlib.Path, dtype: str | None = None) -> Transformer:
    """The ``Transformer`` stored by ``save_model``, in ``dtype`` (None: the stored config's dtype)."""
    with np.load(path) as data:
        config = TransformerConfig.from_dict(json.loads(bytes(data[_CONFIG_KEY]).decode()))
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        names, expected = set(data.files) - {_CONFIG_KEY}, _file_keys(config)
        if names != expected:
            raise ValueError(f"load_model: {path} does not match the config's parameters "
                             f"(missing {sorted(expected - names)[:3]}, extra {sorted(names - expected)[:3]})")
        return assemble_transformer(config, lambda name, layer: (data[_file_key(name, layer)],
                                                                 f"load_model: {_file_key(name, layer)} in {path}"))


def load_demo(weights_dir: str | pathlib.Path | None = None) -> tuple[Transformer, Transformer]:
    """The shipped byte-level demo pair ``(target, draft)`` (vocab 256, trained on Python source)."""
    directory = pathlib.Path(weights_dir) if weights_dir is not None else DEMO_WEIGHTS_DIR
    missing = [n for n in ("target.npz", "draft.npz") if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"load_demo: {missing} not found in {directory}; train them with "
                                f"`python -m scv_jax.demo.train`")
    return load_model(directory / "target.npz"), load_model(directory / "draft.npz")


def load_demo_head(target: Transformer, weights_dir: str | pathlib.Path | None = None, *,
                   dtype: str = "bfloat16") -> Eagle3Head:
    """The shipped EAGLE-3 head of the demo target (``eagle3_head/``, trained by
    ``python -m scv_jax.eagle3_train --target demo``), bound to ``target`` (``load_demo()[0]``), in
    ``dtype`` (as ``load_eagle3``: bfloat16 by default, whatever the target's dtype)."""
    directory = (pathlib.Path(weights_dir) if weights_dir is not None else DEMO_WEIGHTS_DIR) / "eagle3_head"
    return load_eagle3(directory, target, dtype=dtype)
