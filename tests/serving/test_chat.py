"""Chat templates rendered as Hugging Face renders them."""

from __future__ import annotations

import json

import pytest

from scv_jax.serving.chat import ChatTemplate, ChatTemplateError, load_chat_template

# Llama-3-Instruct's template shape: trim_blocks / lstrip_blocks, loop controls, bos_token, raise_exception
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
  {% if loop.index0 > 5 %}{% break %}{% endif %}
  <|{{ message['role'] }}|>{{ message['content'] | trim }}<|end|>
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_renders_with_hf_whitespace_rules_and_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    template = load_chat_template(tmp_path)
    messages = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "héllo"}]
    assert template.render(messages) == "<s>\n  <|system|>be brief<|end|>\n  <|user|>héllo<|end|>\n<|assistant|>"
    assert template.render(messages, add_generation_prompt=False).endswith("<|end|>\n")
    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        template.render([{"role": "tool", "content": "x"}])


def test_tojson_keeps_non_ascii_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "no"}, {"name": "default", "template": "{{ messages | tojson }}"}]}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "€"}]) == \
        '[{"role": "user", "content": "€"}]'


def test_missing_or_broken_templates(tmp_path):
    assert load_chat_template(tmp_path) is None                      # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template does not compile"):
        load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}", {}).render([{"role": "user", "content": "x"}])
