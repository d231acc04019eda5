"""One-command GPU validation and benchmark suite for every scv-jax kernel.

On a CUDA GPU (one call, at most ``--budget-s`` seconds, 8 minutes by default, on an H200):
  1. environment (GPU, driver, jax/jaxlib) and two ceilings: device copy bandwidth and launch floor;
  2. native correctness: every kernel (Pallas backend, not interpret) on fresh random inputs against
     the XLA reference, every layout, dtype and register layout;
  3. the engine end to end (``scv_jax.Engine``: add_request / step until done) on a random Llama-shaped
     float32 model made on the device, for the target alone, a draft model's chain and tree, n-gram
     chains and tries and an EAGLE-3 head's chain and tree, greedy (tokens must equal the target-only engine's) and sampled (seeded; must run
     to max_tokens with ids in range), timed per step beside the memory and launch floors;
  4. timings of each kernel and its XLA reference at the vLLM peer benchmark's sizes: per call (host
     dispatch included) and device time (``harness.device_seconds``: dependent calls chained inside
     one executable), bandwidth, fraction of the copy bandwidth, multiple of the memory floor,
     speed-ups;
  5. the vLLM peer benchmark (vLLM's Triton kernels vs ours on identical inputs, with vLLM's CUDA-graph
     replay as its device time) when its script has been copied to ``.peer/vllm_peer_ab.py``
     (git-ignored; never committed) and torch + triton are importable; its report lands in
     ``--out``/peer and in the suite's markdown;
  6. the test suite's kernel tests under pytest, with the time left;
  7. writes ``suite.json`` and ``suite.md`` under ``--out`` after every section (a time-out keeps
     what finished) and prints the markdown last.
Sections that would not fit the budget are skipped and listed as such.
``--dry-run`` runs the same code on CPU at tiny sizes with the interpret backends (CI runs it).

Run: ``python benchmarks/gpu_suite.py --out DIR [--dry-run] [--budget-s 480] [--skip-engine] [--timings GROUPS]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Callable

# The vLLM peer runs in a child process on the same GPU: let JAX allocate on demand instead of taking
# 75% of the device up front (set before jax is imported).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_acceptance  # noqa: E402
import bench_attention  # noqa: E402
import bench_commit  # noqa: E402
import harness  # noqa: E402
import scv_jax  # noqa: E402
from scv_jax import DecoderConfig, Engine, NgramDrafter, SamplingParams, SpeculativeDecoder, TreeConfig  # noqa: E402
from flax import nnx  # noqa: E402
from scv_jax.models import Eagle3Head, Transformer, TransformerConfig  # noqa: E402
from scv_jax.ops.registry import cuda_available  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_SCRIPT = os.path.join(REPO, ".peer", "vllm_peer_ab.py")


@dataclasses.dataclass
class Sizes:
    """Problem sizes of one suite run (``FULL`` on a GPU, ``DRY`` on CPU)."""
    copy_bytes: int
    greedy_configs: tuple[tuple[int, int], ...]              # (B, k)
    vocab_configs: tuple[tuple[int, int, int], ...]          # (B, k, V): greedy from logits, rejection
    commit_tokens: tuple[int, ...]
    commit_layers: int
    commit_acceptance: tuple[float, ...]
    commit_extra: tuple[tuple[int, int, int, int], ...]      # (T, layers, kv_heads, head_dim), bf16, all written
    check_vocab: int
    check_commit_shape: tuple[int, int, int, int]           # layers, kv_heads, head_dim, tokens
    attention_shape: bench_attention.Shape                  # heads of the attention checks and timings
    attention_checks: tuple[tuple[str, str, str | None, str], ...]   # (layout, cache dtype, scale, q dtype)
    check_attention_size: tuple[int, int, int]              # B, context (ragged up to), T
    attention_configs: tuple[tuple[int, int, int, str], ...]   # timed (B, context, T, cache dtype)
    repeats: int
    inner: int                                              # back-to-back calls per timing sample
    device_iterations: int                                  # chained calls per device-time sample
    peer_budget_s: float                                    # the peer script's --budget-s
    pytest_files: tuple[str, ...]
    pytest_filter: str
    engine: "EngineSizes | None" = None                     # the engine rows (None: none)
    checks: tuple[str, ...] | None = None                   # the native checks run by name (None: all)


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """The engine rows: a random Llama-shaped target (and a 2-layer draft of its width) made on the
    device, ``batch`` requests of ``prompt_len`` tokens (a random 16-token pattern repeated, so n-gram
    lookups match) generating ``max_tokens`` each."""
    model: TransformerConfig
    draft_layers: int
    batch: int
    prompt_len: int
    max_tokens: int
    k: int
    tree: TreeConfig
    block_size: int
    backend: str                                            # DecoderConfig.backend
    budget_s: float                                         # rows that would start later are skipped
    drafters: tuple[str | None, ...] = (None, "model", "eagle3", "ngram")   # the drafter kinds run (others skipped)
    configs: tuple[str, ...] | None = None                  # the configurations run by name (None: all; others skipped)
    sampled: tuple[str | None, ...] = (None, "model", "eagle3", "ngram")    # the drafter kinds also run sampled


# A small Llama shape (GQA 16 query / 4 KV heads, SwiGLU, untied LM head) in float32: greedy speculative
# output then equals autoregressive output exactly (bfloat16 only up to near-tied logits, docs/models.md).
LLAMA_SMALL = TransformerConfig(vocab_size=32_000, num_layers=8, d_model=1024, num_heads=16, num_kv_heads=4,
                                head_dim=64, ffn_dim=2816, rope_theta=5e5, tie_embeddings=False, dtype="float32")
ENGINE_FULL = EngineSizes(model=LLAMA_SMALL, draft_layers=2, batch=8, prompt_len=128, max_tokens=64, k=4,
                          tree=TreeConfig(max_depth=4, branching=4, max_nodes=16), block_size=16, backend="auto",
                          budget_s=240)
ENGINE_DRY = EngineSizes(model=TransformerConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                                                 head_dim=8, ffn_dim=48, tie_embeddings=False),
                         draft_layers=1, batch=2, prompt_len=10, max_tokens=6, k=2,
                         tree=TreeConfig(max_depth=2, branching=2, max_nodes=4), block_size=8, backend="xla",
                         budget_s=120, drafters=(None, "model", "eagle3"),   # n-gram: host drafting, tested elsewhere
                         # each drafter kind, a chain and a tree, overlap on and off once (every row is the same
                         # suite code; each left-out decoder is tested lossless, greedy and sampled, under tests/)
                         configs=("autoregressive", "autoregressive, overlap off", "draft-model chain k=2, overlap off",
                                  "EAGLE-3 head tree (2 deep, 2 wide, 4 nodes)"),
                         sampled=(None,))      # the drafters greedy only (their sampled steps: tests/decoding)
H200_HBM_BYTES_PER_S = 4.8e12          # H200 HBM3e, nominal


# The vLLM peer benchmark's acceptance sizes (../shared/bench/vllm_peer_ab.py: GPU_ACCEPT_CASES).
PEER_VOCAB_CONFIGS = ((1, 4, 32_000), (64, 4, 32_000), (256, 8, 32_000), (32, 8, 152_064), (256, 8, 152_064))
FULL = Sizes(copy_bytes=1 << 30, greedy_configs=((1, 4), (64, 4), (256, 8)), vocab_configs=PEER_VOCAB_CONFIGS,
             commit_tokens=(16, 4096), commit_layers=32, commit_acceptance=(0.3,),
             commit_extra=((4096, 1, 8, 128), (4096, 32, 2, 80), (256, 32, 1, 64)),
             check_vocab=151_936, check_commit_shape=(4, 8, 128, 300), attention_shape=bench_attention.LLAMA_8B,
             attention_checks=(("NHD", "bfloat16", None, "bfloat16"), ("HND", "bfloat16", None, "bfloat16"),
                               ("NHD", "fp8_e4m3", "tensor", "bfloat16"), ("HND", "fp8_e5m2", "head", "bfloat16"),
                               ("NHD", "fp8", "token_head", "bfloat16"), ("HND", "float16", None, "float16"),
                               ("NHD", "float32", None, "float32")),
             check_attention_size=(8, 3000, 9),
             attention_configs=tuple((b, c, t, d) for d in ("bfloat16", "fp8") for b, c, t in (
                 (1, 4096, 9), (1, 16384, 9), (8, 4096, 1), (8, 4096, 9), (8, 16384, 9), (64, 4096, 9),
                 (64, 16384, 5))),
             repeats=7, inner=10, device_iterations=20, peer_budget_s=140,
             pytest_files=("tests/ops/acceptance/test_acceptance.py", "tests/ops/commit/test_commit.py",
                           "tests/ops/attention/test_attention.py"),
             pytest_filter="pallas or gpu or lowers", engine=ENGINE_FULL)
DRY = Sizes(copy_bytes=1 << 20, greedy_configs=((1, 2), (4, 2)), vocab_configs=((2, 2, 600),), commit_tokens=(4,),
            commit_layers=2, commit_acceptance=(0.5,), commit_extra=((4, 1, 1, 64),), check_vocab=600,
            check_commit_shape=(2, 2, 64, 5), attention_shape=bench_attention.TINY,
            attention_checks=(("HND", "fp8", "token_head", "float32"),), check_attention_size=(2, 96, 3),
            attention_configs=((2, 96, 3, "fp8"),), repeats=1, inner=1, device_iterations=1, peer_budget_s=60,
            pytest_files=("tests/ops/acceptance/test_acceptance.py",), pytest_filter="greedy_kernel_lowers",
            engine=ENGINE_DRY,
            # each check function once, rejection with both q modes and dtypes, an fp8 scale and a tiled layout (the
            # interpret kernels against the references for every dtype, layout and scale: tests/ops)
            checks=("greedy acceptance", "greedy from logits float32 (NaN, ties)", "rejection sampling q=probs float32",
                    "rejection sampling q=None bfloat16", "commit HND fp8 scale=token_head",
                    "commit NHD bfloat16 scale=None 1 x 64 (tiled layout)",
                    "attention HND fp8 scale=token_head q=float32"))


class Report:
    """Named sections (data + markdown); rewrites suite.json / suite.md whenever one is set."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.data: dict = {}
        self.markdown: dict[str, str] = {}
        os.makedirs(out_dir, exist_ok=True)

    def set(self, name: str, data, markdown: str = "") -> None:
        self.data[name] = data
        if markdown:
            self.markdown[name] = markdown
        with open(os.path.join(self.out_dir, "suite.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(self.out_dir, "suite.md"), "w") as f:
            f.write(self.text() + "\n")

    def text(self) -> str:
        return "\n\n".join(self.markdown.values())


def log(message: str) -> None:
    print(f"[gpu_suite {time.strftime('%H:%M:%S')}] {message}", flush=True)


def environment() -> dict:
    info = {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
            "python": platform.python_version(), "device": jax.devices()[0].device_kind,
            "platform": jax.devices()[0].platform}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = "unavailable"
    return info


# ---------------------------------------------------------------- native correctness checks


def _check_greedy(kernel: str, sizes: Sizes) -> str:
    rng = np.random.default_rng(1)
    k = 8
    counts = rng.integers(0, k + 1, 64)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    t = int(cu[-1]) + 5
    draft = rng.integers(0, 50, t).astype(np.int32)
    target = np.where(rng.random(t) < 0.8, draft, rng.integers(0, 50, t)).astype(np.int32)
    args = [jnp.asarray(a) for a in (draft, cu, target, rng.integers(0, 50, 64).astype(np.int32))]
    got = scv_jax.accept_greedy(*args, max_spec_len=k, backend=kernel)
    want = scv_jax.accept_greedy(*args, max_spec_len=k, backend="xla")
    for name in ("output_token_ids", "num_accepted", "accept_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
    return "bit-exact"


def _check_greedy_logits(kernel: str, sizes: Sizes, dtype) -> str:
    batch, k, vocab = 32, 4, sizes.check_vocab
    draft, cu, logits, bonus = bench_acceptance.logits_inputs(batch, k, vocab, seed=2)
    logits = logits.astype(dtype)
    logits = logits.at[0].set(jnp.nan).at[1, 7].set(jnp.nan).at[2, 5].set(logits[2].max())   # NaN, a tie
    got = scv_jax.accept_greedy_from_logits(draft, cu, logits, bonus, max_spec_len=k, backend=kernel)
    want = scv_jax.accept_greedy_from_logits(draft, cu, logits, bonus, max_spec_len=k, backend="xla")
    for name in ("output_token_ids", "num_accepted", "accept_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
    return "bit-exact"


def _check_rejection(kernel: str, sizes: Sizes, with_draft_probs: bool, dtype) -> str:
    batch, k, vocab = 32, 4, sizes.check_vocab
    draft, cu, q, p, bonus, keys = bench_acceptance.rejection_inputs(batch, k, vocab, seed=5)
    q = q.astype(dtype) if with_draft_probs else None
    p = p.astype(dtype)
    got = scv_jax.rejection_sample(draft, cu, q, p, bonus, key=keys, max_spec_len=k, backend=kernel)
    want = scv_jax.rejection_sample(draft, cu, q, p, bonus, key=keys, max_spec_len=k, backend="xla")
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
    tokens_got, tokens_want = np.asarray(got.output_token_ids), np.asarray(want.output_token_ids)
    assert np.all((tokens_got >= -1) & (tokens_got < vocab))
    differing = int((tokens_got != tokens_want).sum())
    # Recovered tokens are race winners; a last-ulp difference of log() between Mosaic and XLA can
    # flip a near-tie. Allow at most 1 differing token of 160 emitted, none in acceptance decisions.
    assert differing <= 1, f"{differing} emitted tokens differ from the XLA reference"
    return "bit-exact" if differing == 0 else f"{differing} near-tie token differs"


def _check_commit(kernel: str, sizes: Sizes, layout: str, cache_dtype: str, scale_mode,
                  heads_and_dim: tuple[int, int] | None = None) -> str:
    layers, heads, head_dim, tokens = sizes.check_commit_shape
    if heads_and_dim is not None:
        heads, head_dim = heads_and_dim
    rng = np.random.default_rng(3)
    cache = scv_jax.PagedKVCache.create(layers, 64, 16, heads, head_dim, dtype=cache_dtype, layout=layout,
                                        scale_mode=scale_mode)
    noise = lambda a: jnp.asarray(rng.integers(0, 255, a.shape, np.uint8)).view(a.dtype) if a.dtype.itemsize == 1 \
        else jnp.asarray(rng.standard_normal(a.shape), a.dtype)  # noqa: E731
    cache = cache.replace(k_pages=noise(cache.k_pages), v_pages=noise(cache.v_pages))
    shape = (layers, tokens, heads, head_dim)
    new_k = jnp.asarray(rng.standard_normal(shape) * 20, jnp.bfloat16)
    new_v = jnp.asarray(rng.standard_normal(shape) * 20, jnp.float32)
    slots = jnp.asarray(np.where(rng.random(tokens) < 0.1, -1, rng.permutation(64 * 16)[:tokens]), jnp.int32)
    mask = jnp.asarray(rng.random(tokens) < 0.6)
    got = scv_jax.commit_draft_kv(cache, new_k, new_v, slots, mask, backend=kernel)
    want = scv_jax.commit_draft_kv(cache, new_k, new_v, slots, mask, backend="xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    return "bit-exact"


def _check_attention(kernel: str, sizes: Sizes, layout: str, cache_dtype: str, scale_mode, q_dtype: str,
                     sinks: bool = False) -> str:
    batch, context, tokens = sizes.check_attention_size
    inputs = bench_attention.make_inputs(sizes.attention_shape, batch, context, tokens, cache_dtype, layout=layout,
                                         scale_mode=scale_mode, q_dtype=jnp.dtype(q_dtype), ragged=True, seed=7)
    if sinks:   # gpt-oss: a sink logit per query head, N(0, 4)
        inputs["sinks"] = 2 * jax.random.normal(jax.random.key(8), inputs["q"].shape[2:3], jnp.float32)
    got = np.asarray(scv_jax.paged_attention(**inputs, backend=kernel), np.float32)
    # The reference's float32 products in float32: XLA's default precision runs them as TF32 on a GPU
    # (~1e-3 relative), coarser than the kernel's hi/lo-split products.
    with jax.default_matmul_precision("highest"):
        want = np.asarray(scv_jax.paged_attention(**inputs, backend="xla"), np.float32)
    assert np.all(np.isfinite(got)), "non-finite outputs"
    # A few ulps of the output dtype (bf16 inputs: bf16 P and dequantised K/V operands; float32 and float16
    # inputs run hi/lo-split bf16 products).
    ulps = {"bfloat16": 2.0 ** -6, "float16": 2.0 ** -9, "float32": 1e-4}[q_dtype]
    tolerance = ulps * max(1.0, float(np.abs(want).max()))
    error = float(np.abs(got - want).max())
    assert error <= tolerance, f"max |kernel - xla| = {error:.2e} > {tolerance:.1e}"
    return f"max |err| {error:.1e} (tol {tolerance:.0e})"


def native_checks(kernel: str, sizes: Sizes) -> list[dict]:
    """Each kernel against the XLA reference on fresh random inputs; never raises."""
    checks: list[tuple[str, Callable[[], str]]] = [("greedy acceptance", lambda: _check_greedy(kernel, sizes))]
    for dtype in (jnp.float32, jnp.bfloat16):
        checks.append((f"greedy from logits {jnp.dtype(dtype).name} (NaN, ties)",
                       lambda dtype=dtype: _check_greedy_logits(kernel, sizes, dtype)))
    for with_q in (True, False):
        for dtype in (jnp.float32, jnp.bfloat16):
            checks.append((f"rejection sampling q={'probs' if with_q else 'None'} {jnp.dtype(dtype).name}",
                           lambda with_q=with_q, dtype=dtype: _check_rejection(kernel, sizes, with_q, dtype)))
    for layout in ("NHD", "HND"):
        for cache_dtype, mode in (("float32", None), ("float16", None), ("bfloat16", None),
                                  ("fp8_e4m3", "tensor"), ("fp8_e5m2", "head"), ("fp8", "token_head")):
            checks.append((f"commit {layout} {cache_dtype} scale={mode}",
                           lambda layout=layout, d=cache_dtype, m=mode: _check_commit(kernel, sizes, layout, d, m)))
    for layout, cache_dtype, mode, shape in (("NHD", "bfloat16", None, (1, 64)), ("HND", "fp8", "token_head", (2, 80)),
                                             ("NHD", "fp8_e5m2", "head", (3, 112)), ("HND", "float16", None, (5, 96))):
        checks.append((f"commit {layout} {cache_dtype} scale={mode} {shape[0]} x {shape[1]} (tiled layout)",
                       lambda layout=layout, d=cache_dtype, m=mode, hd=shape: _check_commit(kernel, sizes, layout, d,
                                                                                          m, hd)))
    for config in sizes.attention_checks:
        checks.append(("attention {} {} scale={} q={}".format(*config),
                       lambda config=config: _check_attention(kernel, sizes, *config)))
    checks.append(("attention NHD bfloat16 scale=None q=bfloat16 sinks",
                   lambda: _check_attention(kernel, sizes, "NHD", "bfloat16", None, "bfloat16", sinks=True)))
    results = []
    for name, check in checks:
        if sizes.checks is not None and name not in sizes.checks:
            continue
        start = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as error:  # noqa: BLE001 - the suite reports every failure and goes on
            detail, ok = f"{type(error).__name__}: {str(error)[:300]}", False
        results.append(dict(check=name, ok=ok, detail=detail, seconds=round(time.perf_counter() - start, 2)))
        log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return results


def run_pytest(sizes: Sizes, out_dir: str, timeout_s: float) -> dict:
    """The test suite's kernel tests, natively on the GPU (or a lowering test in a dry run)."""
    junit = os.path.join(out_dir, "pytest.xml")
    env = dict(os.environ, HYPOTHESIS_PROFILE="gpu" if cuda_available() else "ci",
               JAX_PLATFORMS="cuda" if cuda_available() else "cpu")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sizes.pytest_files,
               "-k", sizes.pytest_filter, f"--junitxml={junit}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        tail, code = proc.stdout.strip().splitlines()[-1:] or [""], proc.returncode
    except subprocess.TimeoutExpired:
        tail, code = [f"timed out after {timeout_s:.0f} s"], -1
    result = dict(command=" ".join(command[1:]), returncode=code, summary=tail[0],
                  seconds=round(time.perf_counter() - start, 1), failures=[])
    if os.path.exists(junit):
        import xml.etree.ElementTree as ET
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                result["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    return result


def peer_unavailable_reason() -> str:
    """"" when the vLLM peer benchmark can run here, else why not."""
    if not os.path.exists(PEER_SCRIPT):
        return (f"no {os.path.relpath(PEER_SCRIPT, REPO)} (copy ../shared/bench/vllm_peer_ab.py there; "
                "it is git-ignored)")
    missing = [name for name in ("torch", "triton") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not importable" if missing else ""


def run_peer(sizes: Sizes, out_dir: str, budget_s: float, dry_run: bool) -> dict:
    """The vLLM peer benchmark in a child process; its files go to ``out_dir``/peer."""
    why = peer_unavailable_reason()
    if why:
        return dict(status="skipped", reason=why)
    peer_out = os.path.join(out_dir, "peer")
    command = [sys.executable, PEER_SCRIPT, "--project", REPO, "--out", peer_out, "--budget-s",
               str(int(budget_s)), "--grace-s", "15"] + (["--dry-run"] if dry_run else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=budget_s + 60)
        code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    except subprocess.TimeoutExpired:
        code, tail = -1, [f"timed out after {budget_s + 60:.0f} s"]
    report_path = os.path.join(peer_out, "peer_ab.md")
    markdown = open(report_path).read() if os.path.exists(report_path) else ""
    return dict(status="ran", returncode=code, seconds=round(time.perf_counter() - start, 1),
                command=" ".join(command[1:]), tail=tail, markdown=markdown)


def peer_section(peer: dict) -> str:
    lines = ["### vLLM peer benchmark (vLLM's Triton kernels vs ours, one process, identical inputs)", ""]
    if peer["status"] != "ran":
        return "\n".join(lines + [f"Not run: {peer['reason']}."])
    lines.append(f"`{peer['command']}` (exit {peer['returncode']}, {peer['seconds']} s; files under peer/)")
    return "\n".join(lines + ["", peer["markdown"] or "no peer_ab.md was written: " + " / ".join(peer["tail"])])


# ---------------------------------------------------------------- the engine, end to end


def random_model(config: TransformerConfig, seed: int) -> Transformer:
    """A model with random weights made on the default device (the GPU) by one small jitted program,
    never on the host: the model's shapes from ``nnx.eval_shape``, then uniform weights of std 1 /
    sqrt(fan in) for kernels and 1 for the embedding, norm scales 1 and biases 0, from JAX's "rbg"
    generator. (Flax's own init compiles one program per initializer, or one large one under
    ``nnx.jit``, with normal samples: tens of seconds on a CPU for the same kind of weights.)"""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed))))
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def name(path) -> str:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return next((k for k in reversed(keys) if k in ("kernel", "embedding", "scale", "bias")), "")

    kinds = [(name(path), leaf.shape, leaf.dtype) for path, leaf in paths]

    @jax.jit
    def make(key):
        out = []
        for key, (kind, shape, dtype) in zip(jax.random.split(key, len(kinds)), kinds):
            if kind in ("kernel", "embedding"):
                std = 1.0 if kind == "embedding" else 1.0 / np.sqrt(shape[-2])
                half_width = std * np.sqrt(3.0)           # uniform: cheap to compile, unlike normal's erf_inv
                out.append(jax.random.uniform(key, shape, jnp.float32, -half_width, half_width).astype(dtype))
            else:
                out.append(jnp.full(shape, 1 if kind == "scale" else 0, dtype))
        return out

    return nnx.merge(graphdef, jax.tree.unflatten(treedef, make(jax.random.key(seed, impl="rbg"))))


def weight_bytes_per_forward(model: Transformer) -> int:
    """Parameter bytes one forward reads: every weight, less the input embedding table when the LM head
    is a separate matrix (a forward gathers only its tokens' rows then)."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not model.config.tie_embeddings:
        total -= model.embed.embedding.get_value().nbytes
    return total


def kv_bytes_per_token(config: TransformerConfig) -> int:
    """Bytes of one token's K and V over all layers in a cache of the model's dtype."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize


def engine_prompts(sizes: EngineSizes, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts, each a random 16-token pattern repeated (n-gram lookups always match)."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, sizes.model.vocab_size, (sizes.batch, 16))
    return np.tile(pattern, -(-sizes.prompt_len // 16))[:, :sizes.prompt_len].tolist()


def engine_run(decoder: SpeculativeDecoder, prompts: list[list[int]], params: list[SamplingParams],
               max_steps: int = 10_000) -> dict:
    """``Engine.add_request`` for every prompt, then ``step`` until done; each step timed on the host
    (a step returns after its one fetch, so its wall time is the step's). The first step admits and
    prefills every request (they all fit), so the decode figures leave it out."""
    engine = Engine(decoder)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list] = {i: [] for i in ids}
    step_seconds, step_tokens = [], []
    while engine.has_unfinished() and len(step_seconds) < max_steps:
        start = time.perf_counter()
        outs = engine.step()
        step_seconds.append(time.perf_counter() - start)
        step_tokens.append(sum(len(o.new_token_ids) for o in outs))
        for o in outs:
            outputs[o.request_id].append(o)
    finals = [outputs[i][-1] if outputs[i] else None for i in ids]
    decode_s, decode_tokens = step_seconds[1:], step_tokens[1:]
    return dict(tokens=[list(o.token_ids) if o else [] for o in finals],
                reasons=[o.finish_reason if o else None for o in finals],
                streamed_ok=all(o is not None and [t for x in outputs[i] for t in x.new_token_ids] == list(o.token_ids)
                                for i, o in zip(ids, finals)),
                drafts=sum(o.num_draft_tokens for o in finals if o), accepted=sum(o.num_accepted_tokens for o in finals if o),
                steps=len(step_seconds), first_step_s=step_seconds[0] if step_seconds else None,
                ms_per_step=1e3 * float(np.median(decode_s)) if decode_s else None,
                tokens_per_s=sum(decode_tokens) / sum(decode_s) if decode_s and sum(decode_s) > 0 else None,
                tokens_per_step=sum(decode_tokens) / len(decode_s) if decode_s else None,
                unfinished=engine.has_unfinished(), fallbacks=dict(engine.stats.fallbacks),
                free_blocks_back=engine.num_free_blocks == engine.num_blocks)


def _engine_configs(sizes: EngineSizes) -> list[tuple[str, str | None, DecoderConfig]]:
    """(name, drafter: None / "model" / "ngram" / "eagle3", config) per decoder, the reference (no drafter)
    first, n-gram last (host drafting, the rows a spent section budget skips first); the autoregressive and
    draft-model chain rows again with every step fetched before the next (``overlap=False``: the A/B of
    one step in flight)."""
    max_len = sizes.prompt_len + sizes.max_tokens
    blocks = -(-(max_len + 2 * max(sizes.k, sizes.tree.max_depth)) // sizes.block_size)
    geometry = dict(block_size=sizes.block_size, max_seq_len=blocks * sizes.block_size,
                    num_blocks=sizes.batch * blocks + 1, cache_dtype=sizes.model.dtype, prefill_chunk=128,
                    batch_buckets=(sizes.batch,), context_buckets=(blocks,), backend=sizes.backend)
    chain = DecoderConfig(k=sizes.k, **geometry)
    tree = DecoderConfig(tree=sizes.tree, **geometry)
    synchronous = dataclasses.replace(chain, overlap=False)
    t = sizes.tree
    return [("autoregressive", None, chain), ("autoregressive, overlap off", None, synchronous),
            (f"draft-model chain k={sizes.k}", "model", chain),
            (f"draft-model chain k={sizes.k}, overlap off", "model", synchronous),
            (f"draft-model tree ({t.max_depth} deep, {t.branching} wide, {t.max_nodes} nodes)", "model", tree),
            (f"EAGLE-3 head chain k={sizes.k}", "eagle3", chain),
            (f"EAGLE-3 head tree ({t.max_depth} deep, {t.branching} wide, {t.max_nodes} nodes)", "eagle3", tree),
            (f"n-gram chain k={sizes.k}", "ngram", chain),
            (f"n-gram trie ({t.max_depth} deep, {t.max_nodes} nodes)", "ngram", tree)]


def random_head(target: Transformer, seed: int) -> Eagle3Head:
    """An EAGLE-3 head of the published shape for ``target`` (one layer of its width, taps of layers
    (2, L // 2, L - 3) or the first ones of a shallow target, the full vocabulary), random weights made on
    the device, sharing the target's embedding."""
    config = dataclasses.replace(target.config, num_layers=1, tie_embeddings=False)
    layers = target.config.num_layers
    aux = (2, layers // 2, layers - 3) if layers >= 5 else (0, layers // 2, layers - 1)
    return Eagle3Head(config, target.embed, draft_vocab_size=config.vocab_size, draft_to_target=None,
                      aux_layers=aux, norm_before_residual=False, rngs=nnx.Rngs(seed))


def engine_rows(sizes: EngineSizes, ceilings: dict, hbm_bytes_per_s: float, bandwidth_source: str,
                progress=log) -> dict:
    """The engine end to end through ``scv_jax.Engine`` for each decoder configuration, greedy and
    sampled (temperature 1, a seed per request): greedy tokens must equal the target-only engine's
    (lossless), sampled ones must run to max_tokens with ids in range; steps are timed after a warm-up
    and an untimed run, beside the memory floor (weights + KV read per step / HBM bandwidth) and the
    launch floor. Never raises: a failing row is reported with its error."""
    start = time.perf_counter()
    target = random_model(sizes.model, seed=0)
    draft = random_model(dataclasses.replace(sizes.model, num_layers=sizes.draft_layers), seed=1)
    head = random_head(target, seed=2)
    jax.block_until_ready(jax.tree.leaves(target) + jax.tree.leaves(draft) + jax.tree.leaves(nnx.state(head)))
    target_bytes, draft_bytes = weight_bytes_per_forward(target), weight_bytes_per_forward(draft)
    head_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(head))) - target.embed.embedding.get_value().nbytes
    prompts = engine_prompts(sizes)
    greedy = [SamplingParams(temperature=0.0, max_tokens=sizes.max_tokens)] * sizes.batch
    sampled = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=sizes.max_tokens) for i in range(sizes.batch)]
    mean_context = sizes.prompt_len + sizes.max_tokens / 2
    kv_bytes = sizes.batch * mean_context * kv_bytes_per_token(sizes.model)
    draft_kv_bytes = sizes.batch * mean_context * kv_bytes_per_token(draft.config)
    info = dict(model=dataclasses.asdict(sizes.model), draft_layers=sizes.draft_layers, batch=sizes.batch,
                prompt_len=sizes.prompt_len, max_tokens=sizes.max_tokens, target_weight_bytes=target_bytes,
                draft_weight_bytes=draft_bytes, hbm_gbps=hbm_bytes_per_s / 1e9, bandwidth_source=bandwidth_source,
                launch_floor_us=ceilings["launch_floor_us"], backend=sizes.backend)
    rows, skipped, reference = [], [], None
    for name, drafter, config in _engine_configs(sizes):
        left_out = drafter not in sizes.drafters or (sizes.configs is not None and name not in sizes.configs)
        if left_out or time.perf_counter() - start > sizes.budget_s:
            skipped.append(name)
            why = "left out at these sizes" if left_out else "section budget spent"
            progress(f"engine: skip {name} ({why}; budget {sizes.budget_s:.0f} s)")
            continue
        try:
            drafting = {None: None, "model": draft, "ngram": NgramDrafter(), "eagle3": head}[drafter]
            decoder = SpeculativeDecoder(target, drafting, config=config)
        except Exception as error:  # noqa: BLE001 - the suite reports every failure and goes on
            for mode in ("greedy", "sampled"):
                rows.append(dict(config=name, mode=mode, ok=False, detail=f"setup: {type(error).__name__}: "
                                 f"{str(error)[:300]}"))
            progress(f"FAIL engine {name}: {rows[-1]['detail']}")
            continue
        # bytes one decode step reads: the target's weights and KV once (one verify forward), plus a draft
        # model's (or head's: one layer, weights without the shared embedding) weights and KV once per
        # draft forward (k of a chain, max_depth of a tree)
        draft_forwards = 0 if drafter not in ("model", "eagle3") else (config.tree.max_depth if config.tree else config.k)
        per_forward = (draft_bytes + draft_kv_bytes if drafter == "model"
                       else head_bytes + sizes.batch * mean_context * kv_bytes_per_token(head.config))
        floor_bytes = target_bytes + kv_bytes + draft_forwards * per_forward
        for mode, params in (("greedy", greedy), ("sampled", sampled))[:2 if drafter in sizes.sampled else 1]:
            row = dict(config=name, mode=mode, floor_bytes=int(floor_bytes),
                       memory_floor_us=floor_bytes / hbm_bytes_per_s * 1e6)
            try:
                # the untimed run compiles what the timed one runs (the same shapes): no separate warm-up
                first = time.perf_counter()
                untimed = engine_run(decoder, prompts, params)
                row["first_run_s"] = round(time.perf_counter() - first, 1)
                timed = engine_run(decoder, prompts, params)
                problems = []
                for run in (untimed, timed):
                    if run["unfinished"] or not run["streamed_ok"] or not run["free_blocks_back"]:
                        problems.append("unfinished, a stream not adding up or blocks not back")
                    if run["reasons"] != ["length"] * sizes.batch:
                        problems.append(f"finish reasons {sorted(set(map(str, run['reasons'])))} (want length)")
                    if any(len(t) != sizes.max_tokens or not all(0 <= x < sizes.model.vocab_size for x in t)
                           for t in run["tokens"]):
                        problems.append("a request's tokens are not max_tokens ids in [0, vocab)")
                if mode == "greedy":
                    if drafter is None and reference is None:
                        reference = untimed["tokens"]
                    if reference is None:
                        problems.append("no reference (the target-only row failed)")
                    for run in (untimed, timed):
                        if reference is not None and run["tokens"] != reference:
                            r = next(i for i, (a, b) in enumerate(zip(run["tokens"], reference)) if a != b)
                            at = next((j for j, (a, b) in enumerate(zip(run["tokens"][r], reference[r])) if a != b),
                                      None)
                            problems.append(f"tokens differ from the target-only engine's (request {r}, "
                                            f"position {at})")
                            break
                if timed["fallbacks"]:
                    shape, why = next(iter(timed["fallbacks"].items()))
                    problems.append(f"{len(timed['fallbacks'])} bucket(s) on the XLA fallback, first {shape}: {why}")
                ok = not problems
                lossless = ("identical to target-only" if drafter is not None or not config.overlap else
                            "reference") if mode == "greedy" \
                    else ("repeats with its seeds" if timed["tokens"] == untimed["tokens"] else "seeded rerun differs")
                detail = "; ".join(dict.fromkeys(problems)) if problems else lossless
                row.update(ok=ok, detail=detail, steps=timed["steps"], ms_per_step=timed["ms_per_step"],
                           tokens_per_s=timed["tokens_per_s"], tokens_per_step=timed["tokens_per_step"],
                           first_step_ms=timed["first_step_s"] * 1e3,
                           acceptance=timed["accepted"] / timed["drafts"] if timed["drafts"] else None,
                           fallbacks=timed["fallbacks"])
            except Exception as error:  # noqa: BLE001
                row.update(ok=False, detail=f"{type(error).__name__}: {str(error)[:300]}")
            rows.append(row)
            timing = f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:.0f} tok/s" \
                if row.get("ms_per_step") is not None and row.get("tokens_per_s") is not None else ""
            progress(f"{'PASS' if row['ok'] else 'FAIL'} engine {name} {mode}: {row['detail']} {timing}")
        del decoder
    return dict(info=info, rows=rows, skipped=skipped, seconds=round(time.perf_counter() - start, 1))


def engine_table(engine: dict) -> str:
    info = engine["info"]
    model = info["model"]
    floor_us = info["launch_floor_us"]
    lines = ["### Engine end to end (`scv_jax.Engine`: add_request, step until done)", "",
             f"Random {model['dtype']} target made on the device: {model['num_layers']} layers, hidden "
             f"{model['d_model']}, {model['num_heads']} query / {model['num_kv_heads']} KV heads, vocab "
             f"{model['vocab_size']} ({info['target_weight_bytes'] / 1e6:.0f} MB of weights per forward); draft "
             f"model: {info['draft_layers']} layers of its width ({info['draft_weight_bytes'] / 1e6:.0f} MB); "
             f"{info['batch']} requests of {info['prompt_len']} prompt tokens (a 16-token pattern repeated) "
             f"generating {info['max_tokens']} each; backend {info['backend']}. Greedy rows must give the "
             "target-only engine's tokens exactly (lossless); sampled rows (temperature 1, a seed per "
             "request) must run to max_tokens with ids in range. ms/step: median host wall time of the decode "
             "steps of a second, identical run (its first step, which prefills, left out; the first run compiled "
             "every shape it needs: its wall time is \"first run s\"); tokens/s over those steps. "
             f"Memory floor: bytes a step must read (target weights + KV once, a draft model's per draft "
             f"forward) / {info['hbm_gbps']:.0f} GB/s ({info['bandwidth_source']}); launch floor {floor_us:.1f} µs (an empty jitted call). "
             "Random weights accept few drafts: these rows time the machinery, not the speed-up.", "",
             "| configuration | mode | result | ms/step | tokens/step | tokens/s | acceptance | memory floor µs | "
             "x memory floor | x launch floor | first run s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda value, spec: "" if value is None else format(value, spec)  # noqa: E731
    for r in engine["rows"]:
        ms, floor = r.get("ms_per_step"), r.get("memory_floor_us")
        lines.append(" | ".join([
            f"| {r['config']}", r["mode"], f"{'PASS' if r['ok'] else 'FAIL'}: {r['detail']}", fmt(ms, ".2f"),
            fmt(r.get("tokens_per_step"), ".2f"), fmt(r.get("tokens_per_s"), ".0f"), fmt(r.get("acceptance"), ".2f"),
            fmt(floor, ".1f"), fmt(ms * 1e3 / floor if ms is not None and floor else None, ".1f"),
            fmt(ms * 1e3 / floor_us if ms is not None else None, ".0f"), f"{r.get('first_run_s', '')} |"]))
    if engine["skipped"]:
        lines += ["", f"Skipped (section budget): {', '.join(engine['skipped'])}."]
    return "\n".join(lines)


# ---------------------------------------------------------------- tables


def checks_table(checks: list[dict], pytest_result: dict | None) -> str:
    lines = ["### Native correctness (kernel vs XLA reference, fresh random inputs)", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail']} |" for c in checks]
    if pytest_result is not None:
        lines += ["", f"pytest `{pytest_result['command']}`: {pytest_result['summary']} "
                      f"(exit {pytest_result['returncode']}, {pytest_result['seconds']} s)"]
        lines += [f"- FAILED {name}" for name in pytest_result["failures"]]
    return "\n".join(lines)


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


def timing_table(accept_rows: list[dict], commit_rows: list[dict], ceilings: dict) -> str:
    """Per call and device µs for every kernel and its XLA reference, with bandwidth (from device time)
    and its share of the copy bandwidth, multiples of the launch and memory floors, and speed-ups."""
    copy = ceilings["copy_gbps"]
    floor_us = ceilings["launch_floor_us"]
    vs_xla = bench_acceptance.speedups(accept_rows), bench_acceptance.speedups(accept_rows, "device_seconds")
    vs_separate = (bench_acceptance.fused_speedups(accept_rows),
                   bench_acceptance.fused_speedups(accept_rows, "device_seconds"))
    lines = ["### Timings", "",
             f"Copy bandwidth {copy:.0f} GB/s (read + write); launch floor {floor_us:.1f} µs. Per call: median of "
             "back-to-back jitted calls (host dispatch included). Device: dependent calls chained in one "
             "executable (`harness.device_seconds`). GB/s from device time over the nominal bytes (rejection: "
             "2 * T * V * 4 for p and q, though only the `rows` rejected rows are raced). Ratios are "
             "per call / device.", "",
             "| op | size | backend | µs per call | device µs | x launch floor | GB/s | % of copy | x memory floor | "
             "vs XLA | fused vs argmax+accept |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in accept_rows:
        size = f"B={r['batch']} k={r['k']}" + (f" V={r['vocab']}" if "vocab" in r else "")
        size += f" ({r['rows']} rows raced)" if "rows" in r else ""
        name = r["op"] + (f" ({r['variant']})" if "variant" in r else "")
        dev = r.get("device_seconds")
        gbps = r.get("gbps")
        floor = ""
        if "floor_seconds" in r:
            floor = f"{r['seconds'] / r['floor_seconds']:.1f}"
            floor += f" / {dev / r['floor_device_seconds']:.1f}" if dev and r.get("floor_device_seconds") else ""
        key = bench_acceptance.row_key(r)
        fused = (bench_acceptance.ratio_text(vs_separate, (r["batch"], r["k"], r["vocab"], r["backend"]))
                 if r.get("variant") == "fused" else "")
        lines.append(f"| {name} | {size} | {r['backend']} | {_us(r['seconds'])} | {_us(dev)} | "
                     f"{r['seconds'] * 1e6 / floor_us:.1f} | {'' if gbps is None else f'{gbps:.0f}'} | "
                     f"{'' if gbps is None else f'{100 * gbps / copy:.0f}%'} | {floor} | "
                     f"{bench_acceptance.ratio_text(vs_xla, key) if r['backend'] != 'xla' else ''} | {fused} |")
    shape_key = lambda r: (r["tokens"], r["layers"], r["heads"], r["head_dim"], r["cache_dtype"], r["acceptance"])  # noqa: E731
    xla_commit = {shape_key(r): r for r in commit_rows if r["backend"] == "xla"}
    for r in commit_rows:
        base = xla_commit.get(shape_key(r))
        for kind in ("accepted", "all"):
            if kind == "accepted" and r["acceptance"] >= 1.0:
                continue
            speedup = ""
            if r["backend"] != "xla" and base:
                speedup = f"{base[kind + '_s'] / r[kind + '_s']:.2f}x"
                if r.get(kind + "_device_s") and base.get(kind + "_device_s"):
                    speedup += f" / {base[kind + '_device_s'] / r[kind + '_device_s']:.2f}x"
            gbps = r[kind + "_gbps"]
            size = (f"T={r['tokens']} L={r['layers']} {r['heads']}x{r['head_dim']} {r['cache_dtype']} "
                    + (f"accept {r['acceptance']}" if kind == "accepted" else "write-all"))
            lines.append(f"| commit | {size} | {r['backend']} | {_us(r[kind + '_s'])} | "
                         f"{_us(r.get(kind + '_device_s'))} | {r[kind + '_s'] * 1e6 / floor_us:.1f} | {gbps:.0f} | "
                         f"{100 * gbps / copy:.0f}% | | {speedup} | |")
    return "\n".join(lines)


def _attention_timings(sizes: Sizes, backends: tuple[str, ...], copy_gbps: float) -> list[dict]:
    rows = []
    for batch, context, tokens, cache_dtype in sizes.attention_configs:
        rows += bench_attention.run((batch,), (context,), (tokens,), (cache_dtype,), backends,
                                    shape=sizes.attention_shape, repeats=sizes.repeats, inner=sizes.inner,
                                    steps=2 * sizes.inner, copy_gbps=copy_gbps, progress=log)
    return rows


def timing_groups(sizes: Sizes, backends: tuple[str, ...],
                   ceilings: dict) -> list[tuple[str, str, Callable[[], list[dict]]]]:
    """(name, kind, run) per timing group, most important first (each is skipped when over budget)."""
    common = dict(repeats=sizes.repeats, device_iterations=sizes.device_iterations, progress=log)
    groups = [
        ("rejection sampling", "acceptance", lambda: bench_acceptance.run_rejection(
            sizes.vocab_configs, backends, inner=sizes.inner, **common)),
        ("greedy from logits", "acceptance", lambda: bench_acceptance.run_greedy_logits(
            sizes.vocab_configs, backends, inner=sizes.inner, **common)),
        ("commit", "commit", lambda: bench_commit.run(
            sizes.commit_tokens, backends, acceptance=sizes.commit_acceptance, layers=sizes.commit_layers,
            inner=sizes.inner, **common)),
        ("paged attention", "attention", lambda: _attention_timings(sizes, backends, ceilings["copy_gbps"])),
        ("greedy", "acceptance", lambda: bench_acceptance.run_greedy(
            sizes.greedy_configs, backends, inner=2 * sizes.inner, **common)),
    ]
    for tokens, layers, heads, head_dim in sizes.commit_extra:
        groups.append((f"commit T={tokens} L={layers} {heads}x{head_dim}", "commit", lambda t=tokens, l=layers, h=heads,
                       d=head_dim: bench_commit.run((t,), backends, cache_dtypes=("bfloat16",), acceptance=(1.0,),
                                                    layers=l, heads=h, head_dim=d, inner=sizes.inner, **common)))
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder for suite.json, suite.md, pytest.xml, peer/")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpret backends")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new sections after this")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-engine", action="store_true", help="leave out the engine rows")
    parser.add_argument("--timings", default="", help="comma-separated timing groups to run (default: all), "
                        "e.g. 'paged attention,commit'")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    on_gpu = cuda_available()
    if not on_gpu and not args.dry_run:
        print("error: no CUDA GPU found; use --dry-run on CPU", file=sys.stderr)
        return 2
    sizes, kernel = (FULL, "pallas") if on_gpu and not args.dry_run else (DRY, "interpret")
    chosen = {name.strip() for name in args.timings.split(",") if name.strip()}
    unknown = chosen - {name for name, _, _ in timing_groups(sizes, (kernel, "xla"), {})}
    if unknown:
        parser.error(f"--timings: unknown group(s) {sorted(unknown)}")
    report = Report(args.out)

    env = environment()
    log(f"environment: {env}")
    ceilings = {"copy_gbps": harness.copy_bandwidth(sizes.copy_bytes) / 1e9,
                "launch_floor_us": harness.launch_floor() * 1e6}
    log(f"ceilings: {ceilings}")
    report.set("environment", {**env, **ceilings},
               f"## scv-jax GPU suite ({time.strftime('%Y-%m-%d')})\n\nMachine: {harness.machine()}; "
               f"jax {env['jax']}; Python {env['python']}; nvidia-smi: {env.get('nvidia_smi')}. Command: "
               f"`python benchmarks/gpu_suite.py {' '.join(argv if argv is not None else sys.argv[1:])}`")

    checks = native_checks(kernel, sizes)
    report.set("checks", checks, checks_table(checks, None))

    if sizes.engine is not None and not args.skip_engine:
        if "H200" in env["device"]:
            bandwidth, source = H200_HBM_BYTES_PER_S, "H200 HBM, nominal"
        else:
            bandwidth, source = ceilings["copy_gbps"] * 1e9, "the measured copy bandwidth"
        log(f"engine rows (section budget {sizes.engine.budget_s:.0f} s)")
        engine = engine_rows(sizes.engine, ceilings, bandwidth, source)
        report.set("engine", engine, engine_table(engine))
    else:
        engine = None
        report.set("engine", dict(status="skipped", reason="--skip-engine"))

    # Keep time for the peer (its budget + grace + start-up) and for pytest.
    reserve = (0 if args.skip_peer or peer_unavailable_reason() else sizes.peer_budget_s + 40) + 30
    timings: dict[str, list] = {"acceptance": [], "commit": [], "attention": [], "skipped": []}
    for name, kind, run in timing_groups(sizes, (kernel, "xla"), ceilings):
        if chosen and name not in chosen:
            continue
        if left() < reserve:
            log(f"skip timings of {name}: {left():.0f} s left")
            timings["skipped"].append(name)
            continue
        timings[kind] += run()
        markdown = timing_table(timings["acceptance"], timings["commit"], ceilings)
        if timings["attention"]:
            markdown += "\n\n#### Paged attention\n\n" + bench_attention.markdown_table(timings["attention"])
        if timings["skipped"]:
            markdown += f"\n\nSkipped (budget): {', '.join(timings['skipped'])}."
        report.set("timings", timings, markdown)

    if args.skip_peer:
        peer = dict(status="skipped", reason="--skip-peer")
    else:
        peer_budget = max(0.0, min(sizes.peer_budget_s, left() - 60))
        log(f"vLLM peer benchmark (budget {peer_budget:.0f} s): {peer_unavailable_reason() or 'running'}")
        peer = run_peer(sizes, args.out, peer_budget, args.dry_run) if peer_budget > 30 or not on_gpu else \
            dict(status="skipped", reason=f"budget ({left():.0f} s left)")
    report.set("peer", peer, peer_section(peer))

    pytest_result = None
    if not args.skip_pytest and left() > 30:
        log(f"pytest kernel tests (time left {left():.0f} s)")
        pytest_result = run_pytest(sizes, args.out, timeout_s=left())
        log(f"pytest: {pytest_result['summary']}")
    report.set("pytest", pytest_result)
    report.set("checks", checks, checks_table(checks, pytest_result))
    report.set("total_seconds", round(time.perf_counter() - start, 1))
    print("\n" + report.text())
    failed = ([c for c in checks if not c["ok"]] or (engine and [r for r in engine["rows"] if not r["ok"]])
              or (pytest_result and pytest_result["returncode"] not in (0, 5)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
