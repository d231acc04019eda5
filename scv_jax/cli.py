"""The ``scv-jax`` command: ``scv-jax demo`` (speculative vs autoregressive on the demo models),
``scv-jax generate`` (text in, text out with a Hugging Face checkpoint), ``scv-jax bench`` (the
end-to-end benchmark) and ``scv-jax serve`` (an OpenAI-compatible server, ``scv_jax.serving``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from typing import Any, Callable, Sequence

from scv_jax.arguments import OneLineParser
from scv_jax.demo import WORKLOADS
from scv_jax.launch import check_memory, checkpoints, load_models, ngram_drafter
from scv_jax.serving.detokenize import IncrementalDetokenizer
from scv_jax.serving.tools import TOOL_CALL_PARSERS

DEFAULT_PROMPT = "import sys\n\n\ndef "
# what the memory check's error names for demo and generate: the flags that size their caches
_MEMORY_FLAG, _MEMORY_ADVICE = "--max-new-tokens", "lower --max-new-tokens or shorten --prompt"


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value
    return parse


def _non_negative(note: str = "") -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0{note}, got {text!r}")
        return value
    return parse


_temperature = _non_negative(" (0 = greedy)")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2 ** 32:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 2**32), got {text!r}")
    return value


def _add_ngram_sizes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ngram-min", type=_int_at_least(1), default=1, help="shortest n-gram matched (--ngram)")
    parser.add_argument("--ngram-max", type=_int_at_least(1), default=3, help="longest n-gram matched (--ngram)")


_BYTE_UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
               "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30, "TI": 2 ** 40}


def _byte_size(text: str) -> int:
    """A number of bytes >= 1: an int, or a number with a unit (K, M, G, T: powers of 1000; Ki, Mi, Gi, Ti:
    of 1024; a trailing B allowed), e.g. 500M or 2GiB."""
    body = text.strip().upper().removesuffix("B")
    number = body.rstrip("KMGTI")
    unit = body[len(number):]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        value = float("nan")
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be a byte count >= 1 (e.g. 2000000000, 500M or 2GiB), got {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def _add_suffix_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suffix-max-depth", type=_int_at_least(1), default=24,
                        help="longest suffix of a request's text matched (--suffix)")
    parser.add_argument("--suffix-max-spec-factor", type=_non_negative(), default=1.0,
                        help="drafts per step at most this x the match length (--suffix)")
    parser.add_argument("--suffix-min-token-prob", type=_probability, default=0.1,
                        help="a draft's cumulative empirical probability stays at least this (--suffix)")
    parser.add_argument("--suffix-max-cached-requests", type=_int_at_least(0), default=10000,
                        help="finished requests whose outputs are kept to draft from (--suffix)")


def _add_packed_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--packed-verify", action="store_true",
                        help="the target scores only the drafts each step offers (DecoderConfig.packed_verify)")


# --speculative-config (vLLM's JSON form): the attribute of each method's drafter flag. "model" and
# "revision" (the methods of _MODEL_METHODS) set that flag and its revision; each other field sets one
# flag's attribute, for the methods listed (None: any), checked as that flag is.
_SPECULATIVE_METHODS = {"eagle3": "eagle3", "draft_model": "draft", "ngram": "ngram", "suffix": "suffix"}
_MODEL_METHODS = ("eagle3", "draft_model")
_SPECULATIVE_FIELDS: dict[str, tuple[tuple[str, ...] | None, str, Callable[[str], Any]]] = {
    "num_speculative_tokens": (None, "k", _int_at_least(1)),
    "prompt_lookup_min": (("ngram",), "ngram_min", _int_at_least(1)),
    "prompt_lookup_max": (("ngram",), "ngram_max", _int_at_least(1)),
    "suffix_decoding_max_tree_depth": (("suffix",), "suffix_max_depth", _int_at_least(1)),
    "suffix_decoding_max_spec_factor": (("suffix",), "suffix_max_spec_factor", _non_negative()),
    "suffix_decoding_min_token_prob": (("suffix",), "suffix_min_token_prob", _probability),
    "suffix_decoding_max_cached_requests": (("suffix",), "suffix_max_cached_requests", _int_at_least(0)),
}


def _speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object -> {attribute: value} of the flags it stands for."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    method = config.get("method")
    if not isinstance(method, str) or method not in _SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(f"method must be one of {', '.join(map(repr, _SPECULATIVE_METHODS))}, "
                                         f"got {method!r}")
    flag = _SPECULATIVE_METHODS[method]
    settings: dict[str, Any] = {} if method in _MODEL_METHODS else {flag: True}
    for field, value in config.items():
        if field == "method":
            continue
        if field in ("model", "revision"):
            methods, attribute = _MODEL_METHODS, flag if field == "model" else f"{flag}_revision"
            if not isinstance(value, str) or not value:
                raise argparse.ArgumentTypeError(f"{field} must be a non-empty string, got {value!r}")
        elif field in _SPECULATIVE_FIELDS:
            methods, attribute, parse = _SPECULATIVE_FIELDS[field]
            try:
                value = parse(json.dumps(value))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{field} {error}") from None
        else:
            known = ", ".join(["method", "model", "revision", *_SPECULATIVE_FIELDS])
            raise argparse.ArgumentTypeError(f"unknown field {field!r} (scv-jax reads {known})")
        if methods is not None and method not in methods:
            raise argparse.ArgumentTypeError(f"{field} applies to method {' or '.join(map(repr, methods))}, "
                                             f"not {method!r}")
        settings[attribute] = value
    if method in _MODEL_METHODS and flag not in settings:
        raise argparse.ArgumentTypeError(f"method {method!r} needs a model (a directory or a Hugging Face Hub id)")
    return settings


def _apply_speculative_config(args: argparse.Namespace) -> None:
    """Sets the flags ``--speculative-config`` stands for (over those also given); ValueError naming the
    flags it cannot be given with."""
    if args.speculative_config is None:
        return
    for flag, revision in (("--draft-revision", args.draft_revision), ("--eagle3-revision", args.eagle3_revision)):
        if revision is not None:
            raise ValueError(f"{flag}: not allowed with --speculative-config (give its \"revision\")")
    if "k" in args.speculative_config and args.adaptive:
        raise ValueError("--adaptive: not allowed with --speculative-config's num_speculative_tokens")
    vars(args).update(args.speculative_config)


def _add_models(parser: argparse.ArgumentParser, *, ngram_help: str, suffix_help: str) -> None:
    """``--model`` / ``--revision``, the drafters ``--draft`` (with ``--draft-revision``), ``--eagle3``
    (with ``--eagle3-revision``), ``--ngram``, ``--suffix`` and ``--speculative-config`` (one at most) of
    ``generate`` and ``serve``."""
    parser.add_argument("--model", required=True, metavar="DIR|ID",
                        help="the target: a model directory or a Hugging Face Hub id (org/name)")
    parser.add_argument("--revision", metavar="REV",
                        help="the branch, tag or commit of a Hub id --model (None: its default branch)")
    drafter = parser.add_mutually_exclusive_group()
    drafter.add_argument("--draft", metavar="DIR|ID",
                         help="a draft model (same vocabulary): a directory or a Hugging Face Hub id")
    drafter.add_argument("--eagle3", metavar="DIR|ID",
                         help="an EAGLE-3 draft head trained for --model (docs/eagle3.md), in --dtype: a directory "
                              "or a Hugging Face Hub id")
    drafter.add_argument("--ngram", action="store_true", help=ngram_help)
    drafter.add_argument("--suffix", action="store_true", help=suffix_help)
    drafter.add_argument("--speculative-config", metavar="JSON", type=_speculative_config,
                         help="the drafter in vLLM's form, e.g. '{\"method\": \"eagle3\", \"model\": \"org/head\", "
                              "\"num_speculative_tokens\": 3}'. Methods: eagle3 (--eagle3), draft_model (--draft), "
                              "ngram (--ngram), suffix (--suffix); fields: model, revision, num_speculative_tokens "
                              "(--k), prompt_lookup_min/max (--ngram-min/max), suffix_decoding_max_tree_depth, "
                              "_max_spec_factor, _min_token_prob, _max_cached_requests (--suffix-*); a field "
                              "overrides its flag")
    parser.add_argument("--draft-revision", metavar="REV",
                        help="the branch, tag or commit of a Hub id --draft (None: its default branch)")
    parser.add_argument("--eagle3-revision", metavar="REV",
                        help="the branch, tag or commit of a Hub id --eagle3 (None: its default branch)")


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = OneLineParser(prog="scv-jax", description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = sub.add_parser("demo", help="generate with the demo models: speculative vs autoregressive",
                          formatter_class=formatter)
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (bytes)")
    demo.add_argument("--max-new-tokens", type=_int_at_least(1), default=192, help="tokens to generate")
    demo.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the sampling draws, in [0, 2**32)")
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument("--k", type=_int_at_least(0), default=6,
                      help="fixed drafts per step (0 = no speculation; at most max-new-tokens - 1)")
    mode.add_argument("--adaptive", action="store_true", help="choose k per step (AdaptiveController)")
    demo_drafter = demo.add_mutually_exclusive_group()
    demo_drafter.add_argument("--ngram", action="store_true", help="draft by prompt lookup (n-gram matches in "
                              "the text so far) instead of the draft model")
    demo_drafter.add_argument("--eagle3", action="store_true",
                              help="draft with the shipped EAGLE-3 head (load_demo_head) instead of the draft model")
    _add_ngram_sizes(demo)
    _add_packed_verify(demo)
    generate = sub.add_parser("generate", help="continue a text with a Hugging Face model (a directory or a Hub id)",
                              formatter_class=formatter)
    _add_models(generate, ngram_help="draft by prompt lookup (n-gram matches in the text so far), no draft model",
                suffix_help="suffix decoding: draft from the text so far and earlier outputs, no draft model")
    generate.add_argument("--prompt", required=True, help="text to continue")
    generate.add_argument("--max-new-tokens", type=_int_at_least(1), default=128, help="tokens to generate")
    generate.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    generate.add_argument("--seed", type=_seed, default=0, help="seed of the sampling draws, in [0, 2**32)")
    generate.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                          help="parameter, activation and KV-cache dtype")
    generate.add_argument("--compare", action="store_true",
                          help="also run the target alone and report the speedup")
    generate_mode = generate.add_mutually_exclusive_group()
    generate_mode.add_argument("--k", type=_int_at_least(0), default=4,
                               help="fixed drafts per step (with a drafter; at most max-new-tokens - 1)")
    generate_mode.add_argument("--adaptive", action="store_true", help="choose k per step (AdaptiveController)")
    _add_ngram_sizes(generate)
    _add_suffix_settings(generate)
    _add_packed_verify(generate)
    bench = sub.add_parser("bench", help="end-to-end benchmark on the demo models (with progress)",
                           formatter_class=formatter)
    bench.add_argument("--quick", action="store_true", help="batch 1, greedy only (--batch-sizes 1 --temperatures 0)")
    bench.add_argument("--batch-sizes", type=_int_at_least(1), nargs="+", default=[1, 4, 16],
                       help="batch sizes to run")
    bench.add_argument("--temperatures", type=_temperature, nargs="+", default=[0.0, 1.0],
                       help="temperatures to run (0 = greedy)")
    bench.add_argument("--modes", nargs="+", default=["2", "4", "8", "adaptive"],
                       help="fixed k values and/or 'adaptive'")
    bench.add_argument("--k-values", type=_int_at_least(0), nargs="+", default=[0, 2, 4, 6, 8],
                       help="the k an adaptive mode may pick (DecoderConfig.k_values; one executable each)")
    bench.add_argument("--max-new-tokens", type=_int_at_least(1), default=96, help="tokens per request")
    bench.add_argument("--repeats", type=_int_at_least(1), default=3, help="interleaved timed runs per configuration")
    bench.add_argument("--ngram", action="store_true", help="draft by prompt lookup instead of the draft model")
    bench.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["stdlib"],
                       help="stdlib: the batch sizes x temperatures; mixed: a batch of 8 repetitive and free-form "
                            "prompts; stream: 32 of them, 8 running at once (both greedy)")
    bench.add_argument("--packed", action="store_true", help="also run every speculative mode with packed_verify")
    bench.add_argument("--append", metavar="PATH", help="append the results to this markdown file")
    _add_serve(sub, formatter)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed arguments of the command line ``argv`` (without the program name, e.g. ``["serve",
    "--model", DIR]``): every flag left out at its default."""
    return _parser().parse_args(argv)


def _add_serve(sub, formatter) -> None:
    serve = sub.add_parser("serve", help="serve a Hugging Face model over an OpenAI-compatible HTTP API",
                           formatter_class=formatter)
    _add_models(serve, ngram_help="draft by prompt lookup, no draft model",
                suffix_help="suffix decoding: draft from the text so far and the outputs served before (kept for "
                            "the server's life), no draft model")
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--k", type=_int_at_least(0), default=4, help="fixed drafts per step (with a drafter)")
    mode.add_argument("--adaptive", action="store_true", help="choose k per step (AdaptiveController)")
    serve.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                       help="parameter, activation and KV-cache dtype")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_int_at_least(0), default=8000, help="port to listen on (0: any free one)")
    serve.add_argument("--max-num-seqs", type=_int_at_least(1), default=16, help="most requests decoded at once")
    serve.add_argument("--max-waiting", type=_int_at_least(0), default=256,
                       help="most requests waiting beyond --max-num-seqs before answering 429")
    serve.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=None, metavar="N",
                       help="tokens one engine step computes (vLLM's): the decoding requests' first, then chunks of "
                            "prompts, so a long prompt never stalls the running streams (default: 2048 on a GPU, "
                            "256 on a CPU)")
    serve.add_argument("--max-model-len", type=_int_at_least(2), default=None,
                       help="context length served, prompt + output (default: the model's, at most 2048)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-memory", type=_byte_size, metavar="BYTES",
                      help="memory for the KV caches, e.g. 2GiB: the pool holds the blocks of 16 positions that fit "
                           "(default: --gpu-memory-utilization on a GPU; on a CPU --max-num-seqs full-length requests)")
    pool.add_argument("--gpu-memory-utilization", type=_fraction, metavar="F",
                      help="fraction of the GPU's memory the server may use, weights included (vLLM's; default 0.9 "
                           "on a GPU): the KV caches get what the weights leave")
    pool.add_argument("--num-blocks", type=_int_at_least(1), default=None, help="KV-cache blocks of 16 positions")
    serve.add_argument("--served-model-name", metavar="NAME", help="the model name clients use (default: --model)")
    serve.add_argument("--mesh", metavar="DATA,MODEL", help="decode on a device mesh of DATA x MODEL devices")
    serve.add_argument("--num-processes", default=None, metavar="N",
                       help="processes (hosts) of one serving job, each running this command; 'auto': SLURM, Open "
                            "MPI or Kubernetes tell (default: JAX_NUM_PROCESSES, else 1; docs/serving.md, "
                            "\"Several hosts\")")
    serve.add_argument("--process-id", type=_int_at_least(0), default=None, metavar="I",
                       help="this process's index in the job; 0 serves HTTP (default: JAX_PROCESS_ID)")
    serve.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                       help="process 0's address for the job's coordination (default: JAX_COORDINATOR_ADDRESS)")
    serve.add_argument("--heartbeat-timeout", type=_int_at_least(1), default=20, metavar="SECONDS",
                       help="with several processes: how long a silent process is waited for before the job ends")
    serve.add_argument("--no-warmup", action="store_true",
                       help="compile each step shape when first needed (a faster start, slower first requests)")
    serve.add_argument("--max-request-bytes", type=_int_at_least(1), default=16 * 2 ** 20,
                       help="largest request body accepted (a larger one is a 413)")
    serve.add_argument("--max-prompt-chars", type=_int_at_least(1), default=1_000_000,
                       help="longest prompt (a chat's rendered messages) accepted, checked before tokenizing (a 400)")
    serve.add_argument("--allow-unknown-fields", action="store_true",
                       help="ignore request fields neither OpenAI nor vLLM define (logged, and named in the "
                            "response's X-Ignored-Fields header) instead of answering 400")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help='how tool_choice "auto" reads the model\'s calls (vLLM\'s parsers; default: the chat '
                            "template's format: <tool_call> -> hermes, <|python_tag|> or ipython -> llama3_json)")
    serve.add_argument("--shutdown-timeout", type=_non_negative(), default=30.0, metavar="SECONDS",
                       help="on SIGINT / SIGTERM, how long running requests may finish before they are ended")
    _add_ngram_sizes(serve)
    _add_suffix_settings(serve)
    _add_packed_verify(serve)
    serve.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="fetch every decode step before planning the next (DecoderConfig.overlap=False; the "
                            "default keeps one step in flight)")
    serve.add_argument("--draft-ahead", action="store_true",
                       help="with one step in flight, host drafters (ngram, suffix) propose past the step in "
                            "flight's drafts, assumed accepted, so their steps overlap too (DecoderConfig."
                            "draft_ahead; pays where drafting is much of the host's step: suffix at large batch)")


def _text(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def _utf8(prompt: str) -> str:
    """``--prompt`` checked to be text (a command line that is not UTF-8 arrives with lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"--prompt is not valid UTF-8 (at character {e.start}): pass text in the "
                         "terminal's UTF-8 encoding") from None
    return prompt


def _ratio(value: float, fmt: str) -> str:
    """``value`` formatted, or "-" when it is undefined (nan: no drafts were proposed)."""
    return "-" if math.isnan(value) else format(value, fmt)


def _clamp_k(args: argparse.Namespace) -> None:
    """``--k`` above what a step can use (a step drafts at most max-new-tokens - 1 tokens) is lowered to
    that, with a note on stderr: its drafts would be computed and never verified."""
    most = args.max_new_tokens - 1
    if not args.adaptive and args.k > most:
        print(f"note: --k {args.k} lowered to {most} (a step drafts at most --max-new-tokens - 1 = {most} tokens)",
              file=sys.stderr)
        args.k = most


def _decoder_config(args: argparse.Namespace, prompt_len: int, **fields):
    """A ``DecoderConfig`` for one request of ``prompt_len`` tokens and ``args``' k and length."""
    from scv_jax.decoding.config import DecoderConfig

    config = DecoderConfig(k=args.k, adaptive=args.adaptive, batch_buckets=(1,), packed_verify=args.packed_verify,
                           **fields)
    needed = prompt_len + args.max_new_tokens
    return dataclasses.replace(config, max_seq_len=max(config.max_seq_len, needed),
                               num_blocks=max(config.num_blocks, -(-needed // config.block_size)))


class TextPrinter:
    """Prints one request's text on stdout as ``generate`` emits its tokens (it is ``on_tokens``): the
    server's ``IncrementalDetokenizer``, so never half a UTF-8 character, and a token's cost does not grow
    with the output. ``decode``: token ids -> text; ``context``: the prompt's ids (a tokenizer that drops
    a text's leading space keeps the first output token's)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
        self._detokenizer = IncrementalDetokenizer(decode, context)

    def __call__(self, index: int, tokens: list[int]) -> None:
        print("".join(self._detokenizer.add(token) for token in tokens), end="", flush=True)

    def close(self) -> None:
        """Prints what is held back, then ends the line."""
        print(self._detokenizer.flush(), flush=True)


def _run_decoders(decoders: list, prompt: list[int], args: argparse.Namespace, eos_token_id: list[int] | None,
                  prompt_text: str, decode: Callable[[list[int]], str]):
    """Each decoder's output for ``prompt``, after a warm-up that compiles what it uses (progress on
    stderr); the first decoder's text streams to stdout (after ``prompt_text``) as it is generated."""
    print("compiling (one time) ...", file=sys.stderr, flush=True)
    for decoder in decoders:
        decoder.warmup(1, len(prompt) + args.max_new_tokens, temperatures=args.temperature, progress=True)
    print(prompt_text, end="", flush=True)
    stream = TextPrinter(decode, prompt)
    outputs = []
    for decoder in decoders:
        outputs.append(decoder.generate([prompt], args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                        eos_token_id=eos_token_id, progress=True,
                                        on_tokens=None if outputs else stream))
        if len(outputs) == 1:
            stream.close()
            print()
    return outputs


def _print_stats(args: argparse.Namespace, spec, base=None, *, drafting: bool = True) -> None:
    """The stats table of a speculative run (``drafting``: a drafter was given), against an autoregressive
    one when given."""
    s = spec.stats
    mode = ("adaptive k" if args.adaptive else f"k={args.k}") + (", n-gram" if args.ngram else "") + \
        (", EAGLE-3 head" if getattr(args, "eagle3", False) else "") + \
        (", suffix" if getattr(args, "suffix", False) else "")
    label = f"speculative ({mode})" if drafting else "target only (no drafter)"
    per_position = " ".join(_ratio(a, ".2f") for a in s.acceptance_per_position) or "-"
    rows = [(label, f"{s.tokens_per_second:8.1f} tokens/s", f"{s.wall_seconds:.2f} s")]
    if base is not None:
        b = base.stats
        same = ("yes" if spec.tokens == base.tokens else "NO") if args.temperature == 0 else \
            "n/a (sampling: same distribution, different draws)"
        rows = [("autoregressive", f"{b.tokens_per_second:8.1f} tokens/s", f"{b.wall_seconds:.2f} s"), *rows,
                ("speedup", f"{s.tokens_per_second / b.tokens_per_second:8.2f}x", "")]
    rows += [("mean accepted length", f"{s.mean_accepted_length:8.2f} tokens/step", f"{s.steps} steps"),
             ("acceptance", f"{_ratio(s.acceptance_rate, '8.2f'):>8s}", f"per position: {per_position}")]
    if base is not None:
        rows.append(("greedy outputs identical", same, ""))
    for name, value, extra in rows:
        print(f"{name:26s}{value:22s}{extra}")


def run_demo(args: argparse.Namespace) -> int:
    from scv_jax.decoding.decoder import SpeculativeDecoder
    from scv_jax.models import load_demo, load_demo_head

    prompt = list(_utf8(args.prompt).encode("utf-8"))
    if not prompt:
        raise ValueError("--prompt must not be empty")
    ngram = ngram_drafter(args)      # checks the n-gram sizes before the weights load
    _clamp_k(args)
    target, draft = load_demo()
    drafter = ngram if args.ngram else load_demo_head(target) if args.eagle3 else draft
    config = _decoder_config(args, len(prompt))
    check_memory(config, [target, target] if args.ngram else [target, drafter, target],   # two decoders' caches
                 flag=_MEMORY_FLAG, advice=_MEMORY_ADVICE)
    spec, base = _run_decoders([SpeculativeDecoder(target, drafter, config=config),
                                SpeculativeDecoder(target, None, config=config)], prompt, args, None,
                               _text(prompt), _text)
    _print_stats(args, spec, base)
    return 0 if args.temperature or spec.tokens == base.tokens else 1


def run_generate(args: argparse.Namespace) -> int:
    from scv_jax.decoding.decoder import SpeculativeDecoder
    from scv_jax.models import load_tokenizer
    from scv_jax.models.hf import eos_token_ids

    _apply_speculative_config(args)
    _clamp_k(args)
    dirs = checkpoints(args)
    tokenizer = load_tokenizer(dirs.model)
    prompt = tokenizer.encode(_utf8(args.prompt))
    if not prompt:
        raise ValueError("--prompt encodes to no tokens")
    models = load_models(args, dirs)
    if models.position_limit is not None and len(prompt) + args.max_new_tokens > models.position_limit[0]:
        limit, path = models.position_limit
        raise ValueError(f"--prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceed "
                         f"the model's max_position_embeddings {limit} ({path}/config.json)")
    eos = eos_token_ids(dirs.model)
    config = _decoder_config(args, len(prompt), cache_dtype=args.dtype)
    check_memory(config, models.cached + (models.target,) * args.compare, flag=_MEMORY_FLAG, advice=_MEMORY_ADVICE)
    decoders = [SpeculativeDecoder(models.target, models.drafter, config=config)]
    if args.compare:
        decoders.append(SpeculativeDecoder(models.target, None, config=config))
    spec, *base = _run_decoders(decoders, prompt, args, eos or None, args.prompt, tokenizer.decode)
    _print_stats(args, spec, *base, drafting=models.drafter is not None)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from scv_jax.demo.e2e import adaptive_summary, format_table, run_e2e, write_results
    from scv_jax.demo.report import append_markdown
    from scv_jax.models import load_demo

    modes = []
    for mode in args.modes:
        if mode != "adaptive" and not (mode.isdigit() and int(mode) >= 1):
            raise ValueError(f"--modes: each mode must be a k >= 1 or 'adaptive', got {mode!r}")
        modes.append(mode if mode == "adaptive" else int(mode))
    batch_sizes, temperatures = ([1], [0.0]) if args.quick else (args.batch_sizes, args.temperatures)
    target, draft = load_demo()
    rows = run_e2e(target, draft, batch_sizes=batch_sizes, temperatures=temperatures, modes=modes,
                   max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                   drafter="ngram" if args.ngram else "model",
                   workloads=args.workloads, packed=args.packed, k_values=args.k_values)
    table, summary = format_table(rows), adaptive_summary(rows)
    load = f"load average at the end {os.getloadavg()[0]:.1f}"
    print(f"{table}\n\n{summary}\n({load})")
    if args.append:
        write_results(args.append, table, args.command_line, args.max_new_tokens, args.repeats)
        if summary:
            append_markdown(args.append, f"\nAdaptive vs the best fixed k ({load}):\n\n{summary}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from scv_jax.serving.server import serve

    _apply_speculative_config(args)
    return serve(args)


def main(argv: list[str] | None = None, *, command_line: str | None = None) -> int:
    """Runs the command ``argv`` (default: the process's arguments); ``command_line`` names it in the
    results ``bench --append`` writes (default: ``scv-jax`` and ``argv``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.command_line = command_line or shlex.join(["scv-jax", *argv])
    try:
        return {"demo": run_demo, "generate": run_generate, "bench": run_bench, "serve": run_serve}[args.command](args)
    except (ValueError, OSError) as error:     # a user's mistake (or a file it names): one line, no traceback
        print(f"scv-jax {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"\nscv-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
