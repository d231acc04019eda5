"""Saving and loading transformer weights as float16 ``.npz`` files with their config."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scv_jax.models.config import TransformerConfig
from scv_jax.models.transformer import Transformer

DEMO_WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "demo" / "weights"
_CONFIG_KEY = "__config__"


def _flat_state(model: nnx.Module) -> dict[str, jax.Array]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): var.get_value() for path, var in flat}


def save_model(model: Transformer, path: str | pathlib.Path, dtype=np.float16) -> None:
    """Writes the parameters (cast to ``dtype``) and the config to one ``.npz`` file."""
    arrays = {name: np.asarray(value, dtype) for name, value in _flat_state(model).items()}
    arrays[_CONFIG_KEY] = np.frombuffer(json.dumps(model.config.to_dict()).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_model(path: str | pathlib.Path, dtype=jnp.float32) -> Transformer:
    """A ``Transformer`` with the config and parameters stored by ``save_model`` (as ``dtype``)."""
    with np.load(path) as data:
        config = TransformerConfig(**json.loads(bytes(data[_CONFIG_KEY]).decode()))
        arrays = {name: data[name] for name in data.files if name != _CONFIG_KEY}
    model = Transformer(config, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    names = {"/".join(map(str, path)) for path, _ in flat}
    if names != set(arrays):
        raise ValueError(f"load_model: {path} does not match the config's parameters "
                         f"(missing {sorted(names - set(arrays))[:3]}, extra {sorted(set(arrays) - names)[:3]})")
    for path_, var in flat:
        name = "/".join(map(str, path_))
        if arrays[name].shape != var.get_value().shape:
            raise ValueError(f"load_model: {name} has shape {arrays[name].shape}, "
                             f"expected {var.get_value().shape}")
        var.set_value(jnp.asarray(arrays[name], dtype))
    nnx.update(model, state)
    return model


def load_demo(weights_dir: str | pathlib.Path | None = None) -> tuple[Transformer, Transformer]:
    """The shipped byte-level demo pair ``(target, draft)`` (vocab 256, trained on Python source)."""
    directory = pathlib.Path(weights_dir) if weights_dir is not None else DEMO_WEIGHTS_DIR
    missing = [n for n in ("target.npz", "draft.npz") if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"load_demo: {missing} not found in {directory}; train them with "
                                f"`python -m scv_jax.demo.train`")
    return load_model(directory / "target.npz"), load_model(directory / "draft.npz")
