"""What a batch of arrivals costs the running stream, in process (no server): one greedy request
decodes; at step 4 of each repetition four short requests arrive; the wall time of each engine step is
printed (ms), the arriving step's at index 4. The demo pair exported by ``scv_jax.demo.hf_export`` (as
``bench_startup.py`` does), every executable of ``warmup(16, 512, temperatures=(0.0,))`` compiled first.

    python benchmarks/bench_arrival.py [--checkpoints /tmp/scv_jax_demo_ckpt] [--start-warmup]

``--start-warmup``: ``Engine.start_warmup`` (what ``serve`` runs: on CPU each executable also runs once
on zeros after compiling, ``Compiler.prime``), waited for to the end, instead of ``warmup``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_startup import export_demo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", default=os.path.join(tempfile.gettempdir(), "scv_jax_demo_ckpt"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start-warmup", action="store_true", help="serve's warm-up (primed on CPU)")
    args = parser.parse_args()
    import scv_jax
    from scv_jax.models import load_hf

    target_dir, draft_dir = export_demo(args.checkpoints)
    engine = scv_jax.Engine(load_hf(target_dir), load_hf(draft_dir), config=scv_jax.DecoderConfig(
        k=4, batch_buckets=(1, 2, 4, 8, 16), max_seq_len=512, num_blocks=512))
    if args.start_warmup:
        compiler = engine.start_warmup(16, 512, temperatures=(0.0,))
        compiler.wait()
        compiler.stop()
    else:
        engine.warmup(16, 512, temperatures=(0.0,))
    prompt = list(b"def fibonacci(n):\n    ")
    engine.add_request(prompt, scv_jax.SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(5):
        engine.step()
    for _ in range(args.repeats):
        times = []
        for i in range(12):
            if i == 4:
                for _ in range(4):
                    engine.add_request(prompt, scv_jax.SamplingParams(max_tokens=8, ignore_eos=True))
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        print("step ms:", " ".join(f"{t:.0f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
