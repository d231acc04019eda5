"""Runs ``scv-jax serve`` for the tests: ``python -m tests.serving.launch [--fake] [--fault-on TEXT] --
serve --model DIR ...``. ``--fake``: on ``fake_engine.FakeEngine`` (its step lasts
$SCV_FAKE_STEP_SECONDS, default 0.002 s) instead of the checkpoint's Engine; ``--fault-on TEXT``: the
first ``engine.step()`` run while a request whose prompt holds TEXT's bytes is unfinished raises, as a
fault inside a step would (once per such request)."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _Faulty:
    """``engine`` whose ``step`` raises once for each request added with ``marker`` in its prompt."""

    def __init__(self, engine, marker: bytes):
        self._engine, self._marker, self._armed = engine, list(marker), 0

    def add_request(self, prompt_token_ids, params=None, request_id=None):
        rid = self._engine.add_request(prompt_token_ids, params, request_id)
        ids, n = list(prompt_token_ids), len(self._marker)
        self._armed += any(ids[i:i + n] == self._marker for i in range(len(ids) - n + 1))
        return rid

    def step(self):
        if self._armed:
            self._armed -= 1
            raise RuntimeError("injected fault")
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake", action="store_true")
    parser.add_argument("--fault-on", default="")
    split = sys.argv.index("--")
    args = parser.parse_args(sys.argv[1:split])
    from scv_jax import cli
    from scv_jax.serving import server

    make_engine = server.make_engine

    def patched(serve_args, dirs, tokenizer=None, **kwargs):
        if args.fake:
            from tests.serving.fake_engine import FakeEngine
            max_len = serve_args.max_model_len or 512
            engine = FakeEngine(max_num_seqs=serve_args.max_num_seqs, max_seq_len=max_len,
                                num_blocks=serve_args.num_blocks or 4096,
                                step_seconds=float(os.environ.get("SCV_FAKE_STEP_SECONDS", "0.002")))
            served = server.Served(engine, max_len, 256)
        else:
            served = make_engine(serve_args, dirs, tokenizer, **kwargs)
        if args.fault_on:
            served.engine = _Faulty(served.engine, args.fault_on.encode("utf-8"))
        return served

    server.make_engine = patched
    return cli.main(sys.argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
