"""A checkpoint's chat template (``tokenizer_config.json``'s ``chat_template``), rendered with Jinja2
as Hugging Face's ``apply_chat_template`` does: a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text, and the variables ``messages``, ``add_generation_prompt``, ``tools`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...)."""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any

from scv_jax.models.hub import checkpoint_dir

CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot render these messages (its ``raise_exception`` or a Jinja error)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """``render(messages, add_generation_prompt=True) -> str`` with one compiled template."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat_template does not compile: {e}") from None
        self._special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt of ``messages``; ``tools``: OpenAI's tool objects, as transformers passes them (None
        when the request has none)."""
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self._special_tokens)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(path: str | pathlib.Path, *, revision: str | None = None) -> ChatTemplate | None:
    """The chat template of a model directory (or Hugging Face Hub id at ``revision``), or None when
    its tokenizer_config.json has none.

    A template list (Hugging Face's named templates) gives its "default" one. Raises ValueError naming
    the file when it is not JSON or the template does not compile."""
    file = checkpoint_dir(path, revision=revision) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_bytes())
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{file}: chat_template must be a string or a list of named templates")
    special = {name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    try:
        return ChatTemplate(source, special)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
