"""``scv-jax serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on ``scv_jax.Engine``.

Modules: ``detokenize`` (incremental, UTF-8-safe text and stop strings), ``chat`` (a checkpoint's
chat template, rendered with Jinja2 as Hugging Face does), ``protocol`` (OpenAI request fields ->
``SamplingParams``, error bodies), ``metrics`` (Prometheus, vLLM's names), ``engine_loop`` (the
engine driven from its own thread), ``context`` (``ServingContext``, what the endpoints share),
``runs`` (a request's choices on the engine), ``responses`` (OpenAI's response shapes, the SSE
stream), ``routes`` (the endpoints), ``app`` (``build_app``) and ``server`` (``scv-jax serve``).
Nothing here is imported by ``import scv_jax``.
"""
