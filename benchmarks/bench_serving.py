"""Online serving benchmark in the shape of vLLM's ``benchmark_serving``: streamed completions sent to a
running ``scv-jax serve`` over 127.0.0.1 at a Poisson rate (``--request-rate``, inf: all at once) and/or
a fixed concurrency (``--max-concurrency``), reporting time to first token (TTFT), time per output token
after the first (TPOT, per request), inter-chunk latency, requests/s and output tokens/s.

Against a server you started:

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4

Speculative vs not, one server after another (each started with these ``scv-jax serve`` arguments on a
free port, warmed up, measured, stopped with SIGTERM), on the demo pair exported as checkpoints:

    python -m scv_jax.demo.hf_export /tmp/demo-target --which target
    python -m scv_jax.demo.hf_export /tmp/demo-draft --which draft
    python benchmarks/bench_serving.py --launch "--model /tmp/demo-target" \\
        --launch "--model /tmp/demo-target --draft /tmp/demo-draft --k 4" \\
        --launch "--model /tmp/demo-target --ngram --k 4" --append

Prompts are cut from held-out standard-library source (fixed seed) and sent as token ids;
``ignore_eos`` keeps every output at ``--output-len`` tokens, greedy unless ``--temperature``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 900


@dataclasses.dataclass
class RequestResult:
    ok: bool
    ttft: float = math.nan           # seconds to the first chunk with text
    latency: float = math.nan        # seconds to the last chunk
    chunk_gaps: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str = ""


async def _one(http, url: str, prompt: list[int], args) -> RequestResult:
    body = {"model": None, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps += (now - last,)
                    last = now
                if chunk.get("usage"):          # the last chunk (stream_options.include_usage)
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if "spec_decode" in chunk:      # the chunk with the finish reason
                    result.draft_tokens = chunk["spec_decode"]["num_draft_tokens"]
                    result.accepted_tokens = chunk["spec_decode"]["num_accepted_tokens"]
    except Exception as e:     # noqa: BLE001 (a benchmark reports failed requests, it does not stop)
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    result.ok, result.latency = True, time.perf_counter() - start
    return result


async def run_load(url: str, prompts: list[list[int]], args) -> tuple[list[RequestResult], float]:
    """Sends every prompt (Poisson arrivals at ``args.request_rate``, at most ``args.max_concurrency`` at
    once); (results, wall seconds)."""
    import httpx

    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:
        await _one(http, url, prompts[0], args)          # a first request (compiles nothing: the server warmed up)

        async def limited(prompt):
            async with limit:
                return await _one(http, url, prompt, args)

        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ms = lambda values, q: float(np.percentile(values, q)) * 1e3 if len(values) else math.nan   # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    gaps = [g for r in ok for g in r.chunk_gaps]
    out = sum(r.output_tokens for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall,
            "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out,
            "request_throughput": len(ok) / wall, "output_throughput": out / wall,
            "mean_ttft_ms": float(np.mean(ttft)) * 1e3 if ttft else math.nan,
            "p50_ttft_ms": ms(ttft, 50), "p99_ttft_ms": ms(ttft, 99),
            "mean_tpot_ms": float(np.mean(tpot)) * 1e3 if tpot else math.nan,
            "p50_tpot_ms": ms(tpot, 50), "p99_tpot_ms": ms(tpot, 99),
            "p50_itl_ms": ms(gaps, 50), "p99_itl_ms": ms(gaps, 99),
            "acceptance": sum(r.accepted_tokens for r in ok) / drafted if drafted else math.nan}


def print_report(label: str, s: dict[str, float]) -> None:
    """vLLM benchmark_serving's result block."""
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", s["duration_s"]), ("Total input tokens:", s["input_tokens"]),
            ("Total generated tokens:", s["output_tokens"]), ("Request throughput (req/s):", s["request_throughput"]),
            ("Output token throughput (tok/s):", s["output_throughput"]),
            ("Draft acceptance rate:", s["acceptance"]), None,
            ("Mean TTFT (ms):", s["mean_ttft_ms"]), ("Median TTFT (ms):", s["p50_ttft_ms"]),
            ("P99 TTFT (ms):", s["p99_ttft_ms"]), None,
            ("Mean TPOT (ms):", s["mean_tpot_ms"]), ("Median TPOT (ms):", s["p50_tpot_ms"]),
            ("P99 TPOT (ms):", s["p99_tpot_ms"]), None,
            ("Median ITL (ms):", s["p50_itl_ms"]), ("P99 ITL (ms):", s["p99_itl_ms"])]
    titles = iter(["Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency"])
    print(f"{(' Serving Benchmark Result: ' + label + ' '):=^60}")
    for row in rows:
        if row is None:
            print(f"{' ' + next(titles) + ' ':-^60}")
        else:
            value = row[1]
            print(f"{row[0]:<44}{value:>16.2f}" if isinstance(value, float) else f"{row[0]:<44}{value:>16}")
    print("=" * 60)


class LaunchedServer:
    """``scv-jax serve ARGS --port 0`` in a subprocess; ``url`` once it listens."""

    def __init__(self, serve_args: str, log_path: str):
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "scv_jax", "serve", "--host", "127.0.0.1", "--port", "0",
                   *shlex.split(serve_args)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        deadline, self.url = time.monotonic() + START_TIMEOUT, None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            if line.startswith("scv-jax serve: listening on "):
                self.url = line.split()[-1]
                return
        self.stop()
        raise RuntimeError(f"the server ({serve_args}) did not start; see {log_path}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(60)
        self.log.close()
        return self.process.returncode


def _table(rows: list[tuple[str, dict[str, float]]]) -> str:
    lines = ["| server | done | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | "
             "acceptance |", "|---|---|---|---|---|---|---|---|"]
    for label, s in rows:
        lines.append(f"| `{label}` | {s['completed']}/{s['completed'] + s['failed']} | {s['request_throughput']:.2f} | "
                     f"{s['output_throughput']:.1f} | {s['p50_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
                     f"{s['p50_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | {s['p50_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} | "
                     f"{'-' if math.isnan(s['acceptance']) else format(s['acceptance'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", action="append", metavar="SERVE_ARGS",
                        help="start `scv-jax serve SERVE_ARGS` and measure it (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at t=0")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    parser.add_argument("--input-len", type=int, default=48, help="prompt tokens (bytes)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    from scv_jax.demo.e2e import benchmark_prompts

    prompts = benchmark_prompts(args.num_prompts, args.input_len, seed=args.seed)
    rows = []
    for serve_args in args.launch or [None]:
        server = None if serve_args is None else LaunchedServer(serve_args, f"/tmp/bench_serving_{len(rows)}.log")
        try:
            results, wall = asyncio.run(run_load(args.base_url or server.url, prompts, args))
        finally:
            if server is not None:
                server.stop()
        label = serve_args or args.base_url
        summary = summarize(results, wall)
        print_report(label, summary)
        for failure in [r.error for r in results if not r.ok][:3]:
            print(f"failed: {failure}")
        rows.append((label, summary))
    print(_table(rows))
    if args.append:
        from scv_jax.demo.report import append_markdown, results_header

        command = shlex.join(["python", "benchmarks/bench_serving.py", *(sys.argv[1:] if argv is None else argv)])
        details = (f"`scv-jax serve` over 127.0.0.1, {args.num_prompts} streamed completions of {args.input_len} "
                   f"prompt tokens and {args.output_len} output tokens (ignore_eos), temperature {args.temperature}, "
                   f"request rate {args.request_rate}, max concurrency {args.max_concurrency or 'all'}; "
                   f"load average at the end {os.getloadavg()[0]:.1f}. ")
        append_markdown(os.path.join(ROOT, "benchmarks", "RESULTS.md"),
                        results_header("Serving: bench_serving", command, details) + _table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
