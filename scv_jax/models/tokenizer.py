"""Text <-> token ids with a Hugging Face model directory's (or Hub id's) ``tokenizer.json`` (``tokenizers``
package)."""

from __future__ import annotations

import pathlib
from typing import Sequence

from scv_jax.models.hub import checkpoint_dir

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """A loaded ``tokenizer.json``: ``encode(text) -> ids``, ``decode(ids) -> text``."""

    def __init__(self, backend, source: pathlib.Path):
        self._backend = backend           # a tokenizers.Tokenizer
        self.source = source

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (e.g. Llama's BOS). Releases the GIL while it encodes (the server tokenizes on a worker thread)."""
        if not isinstance(text, str):
            raise ValueError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        # encode_batch, unlike encode, releases the GIL; the same ids
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ``ids`` (special tokens dropped unless ``skip_special_tokens=False``)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Tokenizer.decode: token id {bad[0]} outside [0, vocab_size={self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine reads its vocabulary from)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string of ``token_id`` (e.g. "Ġthe" in a byte-level vocabulary), or None."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (e.g. "</s>"), or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)


def load_tokenizer(path: str | pathlib.Path, *, revision: str | None = None) -> Tokenizer:
    """The tokenizer of a model directory or Hugging Face Hub id (at ``revision``; its ``tokenizer.json``)
    or of a ``tokenizer.json`` file.

    Raises FileNotFoundError when the file is missing (or the id unknown,
    ``scv_jax.models.hub.checkpoint_dir``), ImportError when ``tokenizers`` is not installed and
    ValueError when the file cannot be parsed.
    """
    file = pathlib.Path(path)
    if revision is not None or not file.is_file():
        file = checkpoint_dir(path, revision=revision) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"load_tokenizer: {file} not found")
    try:
        import tokenizers
    except ImportError:
        raise ImportError("load_tokenizer needs the tokenizers package: pip install tokenizers") from None
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:   # tokenizers raises its own exception type for malformed files
        raise ValueError(f"load_tokenizer: {file} is not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
    return Tokenizer(backend, file)
