"""EAGLE-3 draft heads: one Llama decoder layer over the target's own features, loaded from the
published checkpoints (SafeAILab EAGLE / SpecForge and vLLM speculators layouts) and bound to a target.

    target = scv_jax.models.load_hf("/path/to/Llama-3.1-8B-Instruct")
    head = scv_jax.models.load_eagle3("/path/to/EAGLE3-LLaMA3.1-Instruct-8B", target)

The head shares the target's token embedding (checkpoints carry none). Guide: docs/eagle3.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scv_jax.arguments import is_int
from scv_jax.models.attention import causal_attention
from scv_jax.models.config import TransformerConfig, canonical_dtype, rope_scaling_type
from scv_jax.models.hf import config_from_hf, open_safetensors, read_json
from scv_jax.models.hub import checkpoint_dir
from scv_jax.models.protocol import StagedKV
from scv_jax.models.torch_checkpoint import read_torch_state_dict
from scv_jax.models.transformer import Attention, RMSNorm, SwiGLU, Transformer, paged_positions
from scv_jax.ops.attention.sharded import sharded_paged_attention
from scv_jax.ops.commit.kv_cache import PagedKVCache

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# config.json ``architectures`` of the EAGLE-3 layout: SafeAILab's and SpecForge's name, vLLM's name, and
# the plain Llama name of SafeAILab's trainer config (eagle/traineagle3/config.json).
EAGLE3_ARCHITECTURES = (EAGLE3_ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
NORM_BEFORE_RESIDUAL_DEFAULT = False     # SafeAILab's forward; the speculators library's config default
# The decoder layer of a speculators checkpoint: transformer_layer_config.model_type -> the load_hf
# architecture whose layer it is (Qwen3's adds q/k norms).
SPECULATORS_LAYER_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Our parameter path -> (checkpoint tensor name, stored as [out, in] and so transposed). Layer tensors
# are relative to the layout's layer prefix ("midlayer." or "layers.0.").
_LAYER_TENSORS = {
    "input_norm/scale": ("input_layernorm.weight", False),
    "hidden_norm/scale": ("hidden_norm.weight", False),
    "attn/q/kernel": ("self_attn.q_proj.weight", True),
    "attn/k/kernel": ("self_attn.k_proj.weight", True),
    "attn/v/kernel": ("self_attn.v_proj.weight", True),
    "attn/o/kernel": ("self_attn.o_proj.weight", True),
    "attn/q_norm/scale": ("self_attn.q_norm.weight", False),
    "attn/k_norm/scale": ("self_attn.k_norm.weight", False),
    "mlp_norm/scale": ("post_attention_layernorm.weight", False),
    "mlp/gate/kernel": ("mlp.gate_proj.weight", True),
    "mlp/up/kernel": ("mlp.up_proj.weight", True),
    "mlp/down/kernel": ("mlp.down_proj.weight", True),
}
_EMBEDDING = "embed_tokens.weight"
_GLOBAL_TENSORS = {
    "embed/embedding": (_EMBEDDING, False),         # only for a head whose embedding is its own
    "fc/kernel": ("fc.weight", True),
    "fc_input_norm/scale": ("input_norm.weight", False),
    **{f"fc_norm/{i}/scale": (f"fc_norm.{i}.weight", False) for i in range(3)},
    "norm/scale": ("norm.weight", False),
    "lm_head/kernel": ("lm_head.weight", True),
}
# Tensors a checkpoint may carry besides the parameters, by name: the embedding (a copy of the target's,
# or the head's own: load_eagle3), the draft/target vocabulary maps (read separately) and the
# speculators trainer's frozen copies of the verifier's final norm and LM head (training only; its
# Eagle3DraftModel lists them in _keys_to_ignore_on_load_missing). Names ending in
# ``rotary_emb.inv_freq`` (a RoPE buffer older exports saved) are ignored too; any other tensor is an error.
NOT_PARAMETERS = (_EMBEDDING, "d2t", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")


class VocabMap(nnx.Variable):
    """A constant of the checkpoint: int32[draft_vocab], the target id of each draft id."""


class Eagle3Output(NamedTuple):
    """What ``Eagle3Head.forward_paged`` returns.

    Attributes:
      logits: float32[B, T, target vocab] (-inf at target ids outside the draft vocabulary).
      hidden: [B, T, d_model], the layer's output (before the final norm; after it with ``norm_output``):
        the next draft step's ``hidden``.
      keys, values: the new tokens' K/V, [1, B, T, kv_heads, head_dim] (a one-layer cache's), to stage,
        then commit.
    """

    logits: jax.Array
    hidden: jax.Array
    keys: jax.Array
    values: jax.Array


class Eagle3Head(nnx.Module):
    """An EAGLE-3 draft head: ``combine`` projects three target features to one, ``__call__`` /
    ``forward_paged`` run its decoder layer over (token embedding, feature) pairs.

    Attributes:
      config: the layer's ``TransformerConfig`` (``num_layers`` 1, ``vocab_size`` the target's), so a
        paged cache is sized as for a draft model.
      embed: the target's ``nnx.Embed`` (shared, not copied).
      aux_layers: the three target layers whose input hidden states (layer k's input: the output of
        layer k - 1, the embedding for k = 0) ``combine`` takes, in order.
      norm_before_residual: the residual around attention is ``hidden_norm(hidden)`` (True) or
        ``hidden`` (False).
      norm_output: the layer's output passed on (``hidden_out``) is ``norm(h)`` (True, speculators'
        "Eagle 3.1" option) or ``h`` (False).
      fc_norm: per-feature RMSNorms (an ``nnx.List`` of 3) applied to each feature before ``fc``, or None.
      fc_input_norm: one RMSNorm over the concatenated features before ``fc`` (speculators'
        ``norm_before_fc``), or None.
      draft_to_target: ``VocabMap`` of the draft ids' target ids, or None (the vocabularies are one).
    """

    def __init__(self, config: TransformerConfig, embed: nnx.Embed | None, *, draft_vocab_size: int,
                 draft_to_target: np.ndarray | None, aux_layers: tuple[int, int, int],
                 norm_before_residual: bool, rngs: nnx.Rngs, norm_output: bool = False, fc_norm: bool = False,
                 norm_before_fc: bool = False):
        c, dtype = config, config.jnp_dtype
        self.config = c
        self.embed = nnx.data(embed)      # data even while None (the loader attaches the target's)
        self.aux_layers = tuple(aux_layers)
        self.norm_before_residual = norm_before_residual
        self.norm_output = norm_output
        self.fc_norm = nnx.List([RMSNorm(c.d_model, c.norm_eps, dtype) for _ in range(3)]) if fc_norm else None
        self.fc_input_norm = RMSNorm(3 * c.d_model, c.norm_eps, dtype) if norm_before_fc else None
        self.fc = nnx.Linear(3 * c.d_model, c.d_model, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.input_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
        self.hidden_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
        self.attn = Attention(c, rngs, in_features=2 * c.d_model)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps, dtype)
        self.mlp = SwiGLU(c, rngs)
        self.norm = RMSNorm(c.d_model, c.norm_eps, dtype)
        self.lm_head = nnx.Linear(c.d_model, draft_vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                                  preferred_element_type=jnp.float32, rngs=rngs)
        self.draft_to_target = (None if draft_to_target is None
                                else VocabMap(jnp.asarray(draft_to_target, jnp.int32)))

    def combine(self, taps: jax.Array) -> jax.Array:
        """The head's input feature [B, T, d_model] from the ``aux_layers`` features concatenated in
        order, taps [B, T, 3 * d_model] (the ``fc`` projection, after ``fc_norm`` or ``fc_input_norm``)."""
        taps = taps.astype(self.config.jnp_dtype)
        if self.fc_norm is not None:
            taps = jnp.concatenate([norm(tap) for norm, tap in zip(self.fc_norm, jnp.split(taps, 3, axis=-1))],
                                   axis=-1)
        if self.fc_input_norm is not None:
            taps = self.fc_input_norm(taps)
        return self.fc(taps)

    def _logits(self, normed: jax.Array) -> jax.Array:
        """float32[B, T, target vocab] of the final-normed output: the draft vocabulary's logits placed at
        their target ids."""
        draft = self.lm_head(normed)
        if self.draft_to_target is None:
            return draft
        full = jnp.full((*draft.shape[:-1], self.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., self.draft_to_target[...]].set(draft)

    def forward_rows(self, token_ids: jax.Array, hidden: jax.Array, positions: jax.Array,
                     attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
                     out_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The layer over rows (token_ids[B, T], hidden[B, T, d_model]) at positions int32[B, T], the
        rows' queries, keys and values handed to ``attend(q [B, T, heads, D], keys, values [B, T,
        kv_heads, D]) -> [B, T, heads, D]`` (which may attend to other keys as well, as training-time
        test does): (logits, hidden_out, keys, values [B, T, kv_heads, D]).

        ``out_rows`` int32[B]: only request b's row ``out_rows[b]`` queries and gets an output (logits
        [B, 1, V], hidden_out [B, 1, d_model]; ``attend`` gets q [B, 1, heads, D]); every row's keys and
        values are still computed (a catch-up or a prefill, whose other rows only fill the cache)."""
        dtype = self.config.jnp_dtype
        hidden = hidden.astype(dtype)
        normed = self.hidden_norm(hidden)
        x = jnp.concatenate([self.input_norm(self.embed(token_ids).astype(dtype)), normed], axis=-1)
        rows = None if out_rows is None else out_rows[:, None]
        attn_out, keys, values = self.attn(x, positions, lambda q, k, v, _sinks: attend(q, k, v), rows)
        residual = normed if self.norm_before_residual else hidden
        if rows is not None:
            residual = jnp.take_along_axis(residual, rows[:, :, None], axis=1)
        x = residual + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        normed = self.norm(x)
        return self._logits(normed), normed if self.norm_output else x, keys, values

    def __call__(self, token_ids: jax.Array, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dense causal forward over T rows at positions 0..T-1: row t pairs ``hidden[:, t]`` (the
        feature of position t) with ``token_ids[:, t]`` (the token at position t + 1).

        Returns logits float32[B, T, target vocab] and hidden_out [B, T, d_model] (before the final norm,
        after it with ``norm_output``).
        """
        positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1], dtype=jnp.int32), token_ids.shape)
        logits, hidden_out, _, _ = self.forward_rows(
            token_ids, hidden, positions, lambda q, k, v: causal_attention(q, k, v, positions))
        return logits, hidden_out

    def forward_paged(self, token_ids: jax.Array, hidden: jax.Array, cache: PagedKVCache,
                      block_tables: jax.Array, context_lens: jax.Array, staged: StagedKV | None = None, *,
                      tree_parents: jax.Array | None = None, out_rows: jax.Array | None = None,
                      backend: str = "auto") -> Eagle3Output:
        """``__call__``'s rows at positions ``context_lens + staged.lengths + t`` (tree depth for t with
        ``tree_parents``), attending over a one-layer paged ``cache`` (read, never written), the
        ``staged`` K/V ([1, B, S, kv_heads, D]) and the new rows, as ``PagedModel.forward_paged``.

        ``out_rows`` int32[B] (without ``staged`` or ``tree_parents``): the output of request b's row
        ``out_rows[b]`` alone (``forward_rows``), that row attending to the rows before it as staged K/V:
        logits [B, 1, V] and hidden [B, 1, d_model]; keys and values of every row."""
        context_lens, staged_lens, positions = paged_positions(token_ids.shape[1], context_lens, staged,
                                                               tree_parents)
        if out_rows is not None and (staged is not None or tree_parents is not None):
            raise ValueError("Eagle3Head.forward_paged: out_rows takes neither staged nor tree_parents")

        def attend(q, k, v):
            if out_rows is not None:      # the rows before each request's query row read as its staged K/V
                row = out_rows[:, None, None, None]
                before = dict(staged_keys=k[None], staged_values=v[None], staged_lens=out_rows)
                k, v = jnp.take_along_axis(k, row, axis=1), jnp.take_along_axis(v, row, axis=1)
            elif staged is not None:
                before = dict(staged_keys=staged.keys, staged_values=staged.values, staged_lens=staged_lens)
            else:
                before = {}
            return sharded_paged_attention(q, cache, 0, block_tables, context_lens, **before, new_keys=k,
                                           new_values=v, new_token_parents=tree_parents, backend=backend)

        logits, hidden_out, keys, values = self.forward_rows(token_ids, hidden, positions, attend, out_rows)
        return Eagle3Output(logits, hidden_out, keys[None], values[None])


# ---------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class _Settings:
    config: TransformerConfig
    layer_prefix: str
    draft_vocab_size: int
    aux_layers: tuple[int, int, int]
    options: dict[str, bool]        # Eagle3Head's norm_before_residual, norm_output, fc_norm, norm_before_fc


def _flag(raw: dict, field: str, default: bool) -> bool:
    value = raw.get(field, default)
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r}")
    return value


def _aux_layers(ids: Any, field: str, num_layers: int) -> tuple[int, int, int]:
    """The three target layers whose inputs the head reads: the config's ids as they are (vLLM's
    reading), else EAGLE-3's default (2, L // 2, L - 3)."""
    if ids is None:
        if num_layers < 5:
            raise ValueError(f"{field} is needed: the default (2, L // 2, L - 3) does not fit a target of "
                             f"{num_layers} layers")
        return 2, num_layers // 2, num_layers - 3
    if not (isinstance(ids, (list, tuple)) and len(ids) == 3 and all(is_int(k, 0) for k in ids)):
        raise ValueError(f"{field} must be 3 layer ids, got {list(ids) if isinstance(ids, tuple) else ids!r}")
    if max(ids) >= num_layers:
        raise ValueError(f"{field} {list(ids)} must name layers in [0, {num_layers}) (the target's layers)")
    return tuple(ids)


def _settings(raw: Any, target: TransformerConfig, dtype: str) -> _Settings:
    """The head's settings from its config.json (either layout); ValueError naming the field."""
    if not isinstance(raw, dict):
        raise ValueError(f"must hold a JSON object, got {type(raw).__name__}")
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {raw['speculators_model_type']!r} is not supported "
                             "(only 'eagle3')")
        fields, prefix = raw.get("transformer_layer_config"), "layers.0."
        if not isinstance(fields, dict):
            raise ValueError(f"transformer_layer_config must be an object, got {fields!r}")
        model_type = fields.get("model_type", "llama")
        if model_type not in SPECULATORS_LAYER_TYPES:
            raise ValueError(f"transformer_layer_config.model_type {model_type!r} is not supported "
                             f"(supported: {sorted(SPECULATORS_LAYER_TYPES)})")
        architecture = SPECULATORS_LAYER_TYPES[model_type]
        aux = _aux_layers(raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids",
                          target.num_layers)
        norm_output = _flag(raw, "norm_output", False)
    elif raw.get("architectures") in [[name] for name in EAGLE3_ARCHITECTURES]:
        fields, prefix, architecture = raw, "midlayer.", "LlamaForCausalLM"
        eagle_config = raw.get("eagle_config") or {}
        if not isinstance(eagle_config, dict):
            raise ValueError(f"eagle_config must be an object, got {eagle_config!r}")
        if not _flag(eagle_config, "use_aux_hidden_state", True):
            raise ValueError("eagle_config.use_aux_hidden_state: false (a head without fc) is not supported")
        if eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
            aux = _aux_layers(eagle_config["eagle_aux_hidden_state_layer_ids"],
                              "eagle_config.eagle_aux_hidden_state_layer_ids", target.num_layers)
        else:
            aux = _aux_layers(raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids",
                              target.num_layers)
        # SpecForge's norm_output (default true) normalises before lm_head, as every head does.
        if not _flag(raw, "norm_output", True):
            raise ValueError("norm_output: false (logits of the un-normalised output) is not supported")
        norm_output = False
    else:
        raise ValueError(f"architectures {raw.get('architectures')!r} is not supported (an EAGLE-3 head has one "
                         f"of {[[name] for name in EAGLE3_ARCHITECTURES]} or speculators_model_type 'eagle3')")
    fc_norm, norm_before_fc = _flag(raw, "fc_norm", False), _flag(raw, "norm_before_fc", False)
    if fc_norm and norm_before_fc:
        raise ValueError("fc_norm and norm_before_fc are both true: they exclude each other")
    if fields.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings: true is not supported (the head has its own lm_head)")
    layer = config_from_hf({"num_hidden_layers": 1, "vocab_size": target.vocab_size, **fields,
                            "architectures": [architecture]}, dtype=dtype)
    if layer.num_layers != 1:
        raise ValueError(f"num_hidden_layers {layer.num_layers} is not supported (an EAGLE-3 head has 1)")
    for field, value in (("hidden_size", layer.d_model), ("target_hidden_size", raw.get("target_hidden_size"))):
        if value is not None and value != target.d_model:
            raise ValueError(f"{field} {value} differs from the target's hidden size {target.d_model}")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size {layer.vocab_size} differs from the target's vocabulary {target.vocab_size}")
    draft_vocab = target.vocab_size if raw.get("draft_vocab_size") is None else raw["draft_vocab_size"]
    if not is_int(draft_vocab, 1) or draft_vocab > target.vocab_size:
        raise ValueError(f"draft_vocab_size must be an int in [1, {target.vocab_size}] (the target's "
                         f"vocabulary), got {draft_vocab!r}")
    options = dict(norm_before_residual=_flag(raw, "norm_before_residual", NORM_BEFORE_RESIDUAL_DEFAULT),
                   norm_output=norm_output, fc_norm=fc_norm, norm_before_fc=norm_before_fc)
    # max_position_embeddings is the length the head was trained on (2048 in most published heads), not
    # a limit: its RoPE is computed for any position, and the target bounds the context.
    return _Settings(dataclasses.replace(layer, tie_embeddings=False, max_position_embeddings=None), prefix,
                     draft_vocab, aux, options)


# ---------------------------------------------------------------------------------------- tensors
def _read_tensors(directory: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    """The weights file (``WEIGHT_FILES``, first found) and all its tensors."""
    for name in WEIGHT_FILES:
        file = directory / name
        if file.exists():
            break
    else:
        raise FileNotFoundError(f"load_eagle3: {directory} has neither {' nor '.join(WEIGHT_FILES)}")
    if file.suffix == ".bin":
        try:
            return file, read_torch_state_dict(file)
        except ValueError as e:
            raise ValueError(f"load_eagle3: {e}") from None
    with open_safetensors(file, "load_eagle3") as f:
        return file, {name: f.get_tensor(name) for name in f.keys()}


def _draft_to_target(tensors: dict[str, np.ndarray], where: str, draft_vocab: int,
                     target_vocab: int) -> np.ndarray | None:
    """The target id of each draft id (``d2t``: target = draft + d2t[draft]), checked against ``t2d``;
    None where the vocabularies are one."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if draft_vocab < target_vocab:
            raise ValueError(f"load_eagle3: tensor d2t is missing from {where}: draft_vocab_size {draft_vocab} "
                             f"is smaller than the target's vocabulary {target_vocab}")
        return None
    if d2t.shape != (draft_vocab,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"load_eagle3: tensor d2t in {where} must be integers of shape [{draft_vocab}], "
                         f"got {d2t.dtype} {list(d2t.shape)}")
    target_ids = np.arange(draft_vocab) + d2t
    if target_ids.min() < 0 or target_ids.max() >= target_vocab or len(np.unique(target_ids)) != draft_vocab:
        raise ValueError(f"load_eagle3: tensor d2t in {where} maps draft ids outside [0, {target_vocab}) or "
                         "two onto one target id")
    if t2d is not None and (t2d.shape != (target_vocab,)
                            or not np.array_equal(np.flatnonzero(t2d), np.sort(target_ids))):
        raise ValueError(f"load_eagle3: tensor t2d in {where} is not the [{target_vocab}] mask of d2t's target ids")
    return target_ids


def _has_own_embedding(tensors: dict[str, np.ndarray], file: pathlib.Path, target_embed: nnx.Embed) -> bool:
    """Whether the checkpoint's ``embed_tokens.weight`` (when it has one) differs from the target's
    embedding rounded to the checkpoint's dtype, so that the head keeps its own, as vLLM does."""
    embedding = tensors.get(_EMBEDDING)
    if embedding is None:
        return False
    mine = np.asarray(target_embed.embedding[...])
    if embedding.shape != mine.shape:
        raise ValueError(f"load_eagle3: tensor {_EMBEDDING} in {file} has shape {list(embedding.shape)}, the "
                         f"target's embedding {list(mine.shape)}")
    return not np.array_equal(embedding, mine.astype(embedding.dtype))


def _checkpoint_name(path: str, layer_prefix: str) -> tuple[str, bool]:
    if path in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[path]
    name, transposed = _LAYER_TENSORS[path]
    return layer_prefix + name, transposed


def load_eagle3(path: str | pathlib.Path, target: Transformer, *, dtype: str = "bfloat16",
                revision: str | None = None, aux_layers: tuple[int, int, int] | None = None) -> Eagle3Head:
    """An ``Eagle3Head`` with an EAGLE-3 checkpoint's config and weights, sharing ``target``'s embedding
    (unless the checkpoint's ``embed_tokens.weight`` differs from it: then the head keeps its own).

    Args:
      path: a local directory with ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``
        (read without torch), or a Hugging Face Hub id (``org/name``) of one, in the EAGLE-3 layout
        (SafeAILab EAGLE, SpecForge: architectures one of ``EAGLE3_ARCHITECTURES``, the layer under
        ``midlayer.``) or the speculators one (``speculators_model_type: "eagle3"``, the layer under
        ``layers.0.``). Tensors besides the head's parameters must be in ``NOT_PARAMETERS``. The
        config's ``max_position_embeddings`` does not bound the context (``head.config`` has None).
      target: the model whose features the head drafts from (e.g. ``load_hf``'s); same hidden size and
        vocabulary as the checkpoint's.
      dtype: parameter and activation dtype, "bfloat16" (default), "float16" or "float32".
      revision: a Hub id's branch, tag or commit hash (None: its default branch).
      aux_layers: the three target layers whose inputs the head reads, instead of the config's ids
        (``eagle_config.eagle_aux_hidden_state_layer_ids``, taken as they are, as vLLM does) or EAGLE-3's
        default (2, L // 2, L - 3); e.g. each id + 1 to read a SpecForge head as SGLang does.
    Returns:
      The head; its logits are over the target's vocabulary.
    Raises:
      FileNotFoundError: a missing directory, config.json or weights file, an unknown Hub id or
        revision, an id not cached while offline (``scv_jax.models.hub.checkpoint_dir``).
      ValueError: an unsupported layout or config field, a hidden size or vocabulary the target does
        not share, a missing, unexpected or misshapen tensor (the message names the file and field).
    """
    dtype = canonical_dtype(dtype, "load_eagle3: dtype")
    directory = checkpoint_dir(path, revision=revision)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"load_eagle3: {config_file} not found")
    raw = read_json(config_file, "load_eagle3")
    try:
        s = _settings(raw, target.config, dtype)
    except ValueError as e:
        raise ValueError(f"load_eagle3: {config_file}: {e}") from None
    if aux_layers is not None:
        try:
            s = dataclasses.replace(s, aux_layers=_aux_layers(aux_layers, "aux_layers", target.config.num_layers))
        except ValueError as e:
            raise ValueError(f"load_eagle3: {e}") from None
    file, tensors = _read_tensors(directory)
    draft_to_target = _draft_to_target(tensors, str(file), s.draft_vocab_size, target.config.vocab_size)
    own_embedding = _has_own_embedding(tensors, file, target.embed)
    c = s.config

    def new_head() -> Eagle3Head:
        embed = (nnx.Embed(c.vocab_size, c.d_model, dtype=c.jnp_dtype, param_dtype=c.jnp_dtype, rngs=nnx.Rngs(0))
                 if own_embedding else None)
        return Eagle3Head(c, embed, draft_vocab_size=s.draft_vocab_size, draft_to_target=draft_to_target,
                          aux_layers=s.aux_layers, rngs=nnx.Rngs(0), **s.options)

    abstract = nnx.eval_shape(new_head)
    graphdef, state = nnx.split(abstract)
    used = set()
    for path_parts, var in nnx.to_flat_state(state):
        name = "/".join(map(str, path_parts))
        spec = var.get_value()
        if name == "draft_to_target":
            var.set_value(jnp.asarray(draft_to_target, spec.dtype))
            continue
        hf_name, transposed = _checkpoint_name(name, s.layer_prefix)
        if hf_name not in tensors:
            raise ValueError(f"load_eagle3: tensor {hf_name} is missing from {file}")
        tensor = tensors[hf_name]
        expected = tuple(reversed(spec.shape)) if transposed else tuple(spec.shape)
        if tensor.shape != expected or not jnp.issubdtype(tensor.dtype, jnp.floating):
            raise ValueError(f"load_eagle3: tensor {hf_name} in {file} is {tensor.dtype} {list(tensor.shape)}, "
                             f"config.json implies floating point {list(expected)}")
        var.set_value(jnp.asarray(tensor.T if transposed else tensor).astype(spec.dtype))
        used.add(hf_name)
    extra = sorted(n for n in tensors if n not in used and n not in NOT_PARAMETERS
                   and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"load_eagle3: tensor {extra[0]} in {file} is not used by an EAGLE-3 head (known "
                         f"extras: {', '.join(NOT_PARAMETERS)})")
    head = nnx.merge(graphdef, state)
    if not own_embedding:
        head.embed = target.embed
    return head


def save_eagle3(head: Eagle3Head, path: str | pathlib.Path, *, dtype: str = "float16") -> pathlib.Path:
    """Writes ``head`` as an EAGLE-3 checkpoint in the SafeAILab/SpecForge layout (what ``load_eagle3``,
    vLLM and SGLang read): ``config.json`` (architectures ``["LlamaForCausalLMEagle3"]``, the Llama
    fields, ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
    ``model.safetensors`` (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``
    int64[draft_vocab], ``t2d`` bool[target vocab]; ``fc_norm.*`` / ``input_norm.weight`` with their
    flags when the head has them; no embedding, not even a head's own). Weights in ``dtype``, "float16"
    (default) or "float32". Returns the directory (created). A head this layout cannot describe (q/k
    norms, ``norm_output``) is a ValueError."""
    from safetensors.numpy import save_file

    if dtype not in ("float16", "float32"):
        raise ValueError(f"save_eagle3: dtype must be 'float16' or 'float32', got {dtype!r}")
    for unsupported, what in ((head.config.qk_norm, "q/k norms (a Qwen3 layer)"), (head.norm_output, "norm_output")):
        if unsupported:
            raise ValueError(f"save_eagle3: a head with {what} cannot be written in the EAGLE-3 layout")
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    c = head.config
    tensors = {}
    for path_parts, var in nnx.to_flat_state(nnx.state(head, nnx.Param)):
        name = "/".join(map(str, path_parts))
        if name.startswith("embed/"):
            continue                                    # the target's, shared
        hf_name, transposed = _checkpoint_name(name, "midlayer.")
        value = np.asarray(var.get_value(), np.float32)
        tensors[hf_name] = np.ascontiguousarray((value.T if transposed else value).astype(dtype))
    draft_vocab = tensors["lm_head.weight"].shape[0]
    target_ids = (np.arange(draft_vocab) if head.draft_to_target is None
                  else np.asarray(head.draft_to_target[...]))
    tensors["d2t"] = (target_ids - np.arange(draft_vocab)).astype(np.int64)
    tensors["t2d"] = np.isin(np.arange(c.vocab_size), target_ids)
    save_file(tensors, str(directory / "model.safetensors"))
    rope_scaling = None if c.rope_scaling is None else {
        "rope_type": rope_scaling_type(c.rope_scaling),
        **{k: v for k, v in dataclasses.asdict(c.rope_scaling).items() if v is not None}}
    config = {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_scaling": rope_scaling,
              "max_position_embeddings": c.max_position_embeddings or 2048, "vocab_size": c.vocab_size,
              "tie_word_embeddings": False, "torch_dtype": dtype, "draft_vocab_size": draft_vocab,
              "norm_before_residual": head.norm_before_residual,
              **({"fc_norm": True} if head.fc_norm is not None else {}),
              **({"norm_before_fc": True} if head.fc_input_norm is not None else {}),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}}
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory
