"""``ServingContext``: what the endpoints share, one per app (``build_app`` keeps it on ``app.state``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from scv_jax.serving.chat import ChatTemplate
from scv_jax.serving.engine_loop import EngineLoop
from scv_jax.serving.metrics import ServerMetrics


@dataclasses.dataclass
class ServingContext:
    """What the endpoints need: the engine loop, the tokenizer (``encode`` / ``decode`` / ``vocab_size``),
    the chat template (None: the model has none), the served name, the context length, the most
    requests in flight (running + waiting) before a 429, the limits on a body's bytes and a prompt's
    characters, whether unknown request fields are ignored (else a 400), and the tool-call parser of
    ``tool_choice: "auto"`` (None: the chat template's, ``tools.template_parser``)."""

    engine_loop: EngineLoop
    tokenizer: Any
    chat_template: ChatTemplate | None
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    max_in_flight: int
    max_request_bytes: int
    max_prompt_chars: int
    allow_unknown_fields: bool = False
    tool_call_parser: str | None = None
    in_flight: int = 0
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
