"""Start-up cost of ``scv-jax serve`` and ``Engine.warmup`` on the demo pair: the executables compiled
(count, seconds each, grouped by dimension), from an empty persistent compilation cache (cold) and from
the same cache again (warm); the time until the server listens (``/health`` answers 200), the first
token's latency after that, and the stall other streams see when a request with ``logprobs`` arrives.

    python benchmarks/bench_startup.py                      # serve cold + warm, then Engine.warmup
    python benchmarks/bench_startup.py --skip-engine --serve-args "--max-num-seqs 4" --append

Each server runs in a subprocess with ``SCV_JAX_CACHE_DIR`` set to a fresh directory (cold), then the
same one (warm). The per-executable seconds come from the warm-up's progress lines on stderr
(``[decode_step] warm-up i/n (batch=.., blocks=.., k=.., greedy=..) ...``) and its background-compile
log lines; ``Engine.warmup`` runs in this process with ``CompileCounter``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 1200
# "[decode_step] warm-up 3/20 (batch=4, blocks=16, ...) 1.23s" (older: cumulative seconds at the end);
# "[decode_step] compiled (batch=4, ...) in 1.23s ..." (this change's per-executable lines)
_PROGRESS = re.compile(r"^\[(\w+)\] warm-up (\d+)/(\d+) \(([^)]*)\)(?: \[fallback\])? (?:compile ([\d.]+)s, )?([\d.]+)s")
_COMPILED = re.compile(r"\[(\w+)\] (?:background-)?compiled \(([^)]*)\) in ([\d.]+)s")


def export_demo(directory: str) -> tuple[str, str]:
    """The demo pair as Hugging Face checkpoints under ``directory`` (exported once)."""
    target, draft = os.path.join(directory, "demo-target"), os.path.join(directory, "demo-draft")
    for path, which in ((target, "target"), (draft, "draft")):
        if not os.path.exists(os.path.join(path, "config.json")):
            subprocess.run([sys.executable, "-m", "scv_jax.demo.hf_export", path, "--which", which], check=True,
                           cwd=ROOT)
    return target, draft


def parse_compiles(log: str) -> list[tuple[str, dict[str, str], float]]:
    """(executable, {dim: value}, seconds) of each executable a log's warm-up lines name."""
    out, last = [], {}
    for line in log.splitlines():
        m = _PROGRESS.match(line.strip())
        if m:
            name, shape, own, total = m.group(1), m.group(4), m.group(5), float(m.group(6))
            previous = last.get(name, 0.0)      # older lines: each warm-up call restarts the clock
            seconds = float(own) if own is not None else total - previous if total >= previous else total
            last[name] = total
        else:
            m = _COMPILED.search(line)
            if not m:
                continue
            name, shape, seconds = m.group(1), m.group(2), float(m.group(3))
        dims = dict(part.split("=", 1) for part in shape.split(", ") if "=" in part)
        out.append((name, dims, seconds))
    return out


def group_table(compiles: list[tuple[str, dict[str, str], float]]) -> list[str]:
    """Markdown rows: per executable and per value of each dimension, count and seconds."""
    rows = ["| executable | dimension | value | count | seconds |", "| --- | --- | --- | --- | --- |"]
    by_name = collections.defaultdict(list)
    for name, dims, seconds in compiles:
        by_name[name].append((dims, seconds))
    for name, items in by_name.items():
        rows.append(f"| {name} | (all) | | {len(items)} | {sum(s for _, s in items):.1f} |")
        for dim in ("batch", "blocks", "k", "greedy", "logprobs", "packed_k"):
            groups = collections.defaultdict(list)
            for dims, seconds in items:
                if dim in dims:
                    groups[dims[dim]].append(seconds)
            if len(groups) > 1:
                for value, secs in sorted(groups.items(), key=lambda item: (len(item[0]), item[0])):
                    rows.append(f"| {name} | {dim} | {value} | {len(secs)} | {sum(secs):.1f} |")
    return rows


async def _stream(http, url: str, body: dict) -> tuple[float, list[float], float]:
    """(seconds to the first chunk with text, the times of every text chunk, seconds to the end)."""
    start, times = time.perf_counter(), []
    async with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return times[0] - start if times else float("nan"), times, time.perf_counter() - start


async def probe(url: str) -> dict[str, float]:
    """First-token latency of a first request; then, for a logprobs request, a sampled one and a batch of
    four (each a shape the running stream has not used), and a batch of four again (shapes run before),
    the worst gap between chunks of a running greedy stream while they ran, against that stream's median
    gap."""
    import httpx

    prompt = list(b"def fibonacci(n):\n    ")
    base = {"model": None, "prompt": prompt, "ignore_eos": True, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as http:
        ttft, _, _ = await _stream(http, url, {**base, "max_tokens": 8})
        results = {"first_token_s": ttft}
        for label, extra, count in (("logprobs", {"logprobs": 2}, 1), ("sampled", {"temperature": 0.8}, 1),
                                    ("batch", {}, 4), ("batch_again", {}, 4)):
            background = asyncio.create_task(_stream(http, url, {**base, "max_tokens": 480}))
            await asyncio.sleep(0.3)
            arrived = time.perf_counter()
            await asyncio.gather(*(_stream(http, url, {**base, **extra, "max_tokens": 8}) for _ in range(count)))
            done = time.perf_counter()
            _, times, _ = await background
            gaps = [b - a for a, b in zip(times, times[1:])]
            window = [b - a for a, b in zip(times, times[1:]) if b > arrived and a < done]
            results[f"stall_{label}_s"] = max(window, default=float("nan"))
            results[f"median_gap_{label}_s"] = sorted(gaps)[len(gaps) // 2] if gaps else float("nan")
        return results


def run_server(serve_args: str, cache_dir: str, log_path: str, probe_it: bool, settle: bool = False) -> dict:
    """Starts ``scv-jax serve`` with this cache, times it until it listens, probes it (``settle``: once
    the background compiles are done), stops it."""
    import httpx

    env = {**os.environ, "SCV_JAX_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "scv_jax", "serve", "--host", "127.0.0.1", "--port", "0",
               *shlex.split(serve_args)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env)
        url, deadline = None, time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("scv-jax serve: listening on "):
                url = line.split()[-1]
                break
        if url is None:
            process.kill()
            raise RuntimeError(f"the server did not start; see {log_path}")
        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.05)
        result = {"listen_s": time.perf_counter() - start}
        with open(log_path) as early:
            result["compiled_before_listening"] = len(parse_compiles(early.read()))
        if settle:      # every background compile done first: the stalls that remain are the steps' own
            while time.monotonic() < deadline and not re.search(r"warm-up (\d+)/\1 ", open(log_path).read()):
                time.sleep(0.5)
        if probe_it:
            result.update(asyncio.run(probe(url)))
        process.send_signal(signal.SIGTERM)
        result["exit_status"] = process.wait(300)
        result["stop_s"] = time.perf_counter() - start - result["listen_s"]
    with open(log_path) as log:
        result["compiles"] = parse_compiles(log.read())
    return result


def run_engine_warmup(max_num_seqs: int, max_len: int, workers: int | None) -> tuple[float, int, int]:
    """``Engine.warmup`` on the demo pair in this process from an empty persistent cache, ``workers``
    compile threads: (seconds, executables, XLA compiles)."""
    import jax

    import scv_jax
    from scv_jax.graph.compile_counter import CompileCounter
    from scv_jax.graph.persistent_cache import enable_persistent_cache
    from scv_jax.models import load_demo

    enable_persistent_cache(tempfile.mkdtemp(prefix="scv_jax_startup_engine_"))     # cold
    jax.clear_caches()
    target, draft = load_demo()
    engine = scv_jax.Engine(target, draft, config=scv_jax.DecoderConfig(
        k=4, batch_buckets=tuple(b for b in (1, 2, 4, 8, 16) if b < max_num_seqs) + (max_num_seqs,),
        max_seq_len=max_len, num_blocks=max_num_seqs * -(-max_len // 16)))
    start = time.perf_counter()
    with CompileCounter() as counter:
        count = engine.warmup(max_num_seqs, max_len, progress=True, workers=workers)
    return time.perf_counter() - start, count, counter.compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-args", default="", help="extra `scv-jax serve` flags (default flags otherwise)")
    parser.add_argument("--checkpoints", default=os.path.join(tempfile.gettempdir(), "scv_jax_demo_ckpt"))
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--no-probe", action="store_true", help="do not send requests once listening")
    parser.add_argument("--settle", action="store_true", help="probe once every background compile is done")
    parser.add_argument("--engine-max-len", type=int, default=256)
    parser.add_argument("--engine-max-num-seqs", type=int, default=4)
    parser.add_argument("--engine-workers", default="1,2", help="compile threads of each Engine.warmup timed")
    parser.add_argument("--cache-dir", help="the persistent cache directory (default: a new, empty one)")
    parser.add_argument("--phases", default="cold,warm", help="which starts to time, in order")
    parser.add_argument("--label", default="", help="a label for RESULTS.md (e.g. before / after)")
    parser.add_argument("--append", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    lines = []
    if not args.skip_serve:
        target, draft = export_demo(args.checkpoints)
        serve_args = f"--model {target} --draft {draft} {args.serve_args}"
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="scv_jax_startup_cache_")
        for phase in args.phases.split(","):
            log_path = os.path.join(tempfile.gettempdir(), f"bench_startup_{phase}.log")
            result = run_server(serve_args, cache_dir, log_path, probe_it=not args.no_probe, settle=args.settle)
            compiles = result.pop("compiles")
            summary = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            print(f"serve {phase}: {summary}; {len(compiles)} warm-up executables, "
                  f"{sum(s for _, _, s in compiles):.1f} s of compiling (log: {log_path})", flush=True)
            lines.append(f"- serve {phase}: {summary}; {len(compiles)} executables in the warm-up lines, "
                         f"{sum(s for _, _, s in compiles):.1f} compile-seconds")
            if phase == "cold" and compiles:
                lines += ["", *group_table(compiles), ""]
    if not args.skip_engine:
        for workers in (int(w) for w in args.engine_workers.split(",")):
            seconds, count, compiled = run_engine_warmup(args.engine_max_num_seqs, args.engine_max_len, workers)
            line = (f"Engine.warmup({args.engine_max_num_seqs}, {args.engine_max_len}) cold, {workers} compile "
                    f"thread(s): {seconds:.1f} s for {count} executables ({compiled} compiled by XLA)")
            print(line, flush=True)
            lines.append(f"- {line}")
    if args.append:
        import jax
        header = (f"\n## Start-up{f' ({args.label})' if args.label else ''} ({datetime.date.today()}, 2-core CPU, "
                  f"jax {jax.__version__})\n\n`python benchmarks/bench_startup.py {' '.join(sys.argv[1:])}` "
                  f"(demo pair, `scv-jax serve --model demo-target --draft demo-draft {args.serve_args}`):\n\n")
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
