"""The server's Prometheus metrics under vLLM's names (``prometheus_client``, one registry per server).

Counters: ``vllm:request_success_total{finished_reason}``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total`` and the speculative ones, ``vllm:spec_decode_num_drafts_total``
(request-steps that drafted), ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``,
``vllm:num_preemptions_total`` (running requests preempted when the KV blocks ran out),
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens looked up in the prefix
cache / found there);
gauges ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (the
fraction of the KV-cache blocks held by requests: 0 when the pool is full again); histograms
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``. Every metric has vLLM's ``model_name`` label.
"""

from __future__ import annotations

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    """The metrics of one server; ``render() -> (body bytes, content type)`` for ``GET /metrics``."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels, self._model = ["model_name"], model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        self.request_success = counter("vllm:request_success", "Finished requests, by finish reason",
                                       ("finished_reason",))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Request-steps that proposed drafts")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ("position",))
        self.preemptions = counter("vllm:num_preemptions", "Running requests preempted (to resume later) when the "
                                   "KV-cache blocks ran out")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache (not computed)")
        self._counted = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels,
                             registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", labels,
                             registry=self.registry)

        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the KV-cache blocks in use", labels,
                              registry=self.registry)

        def histogram(name: str, doc: str):
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first generated token")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per generated token after the first")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token")
        for reason in ("stop", "length", "abort", "error"):   # present at 0 from the start
            self.request_success.labels(self._model, reason)
        for gauge in (self.running, self.waiting, self.kv_usage):
            self.labels(gauge)

    def labels(self, metric, *values: str):
        return metric.labels(self._model, *values)

    def observe_engine(self, engine) -> None:
        """The gauges from ``engine`` (its thread calls this)."""
        self.labels(self.running).set(engine.num_running)
        self.labels(self.waiting).set(engine.num_waiting)
        self.labels(self.kv_usage).set(1 - engine.num_free_blocks / engine.num_blocks)
        for name, metric in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits)):
            total = getattr(engine.stats, name)       # the engine's counts over its life
            self.labels(metric).inc(total - self._counted[name])
            self._counted[name] = total

    def add_spec_decode(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos) -> None:
        """One step's speculative counts of one request (increments)."""
        if drafts:
            self.labels(self.num_drafts).inc(drafts)
            self.labels(self.num_draft_tokens).inc(draft_tokens)
            self.labels(self.num_accepted_tokens).inc(accepted)
        for position, count in enumerate(accepted_per_pos):
            if count:
                self.labels(self.accepted_per_pos, str(position)).inc(count)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
