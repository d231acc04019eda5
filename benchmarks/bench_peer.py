"""scv-jax against Hugging Face transformers on the same CPU: runs the shared peer benchmark
(``shared/bench/transformers_peer/bench_vs_transformers.py``; in CI the shared folder is ``../shared``
beside the clone) and appends its tables to RESULTS.md with date, machine, versions and load average.

Needs the peer's own venv with torch and transformers (``PEER_TORCH_PYTHON``, default
``.peer/torch-venv/bin/python``) and the demo pair exported for it (``PEER_HF_DIR``, default
``.peer/hf``): ``bash ../shared/bench/transformers_peer/setup.sh`` makes both. Neither is ever a
dependency of scv-jax: without them this prints one line and exits 2.

The driver re-runs a call while other processes use more than 5% of a core during it;
``--max-retries`` bounds that (the peer's own default 5 makes a shared machine's run take hours) and
``--max-quiet-wait`` the wait for a quiet machine before each configuration.

Run: ``python benchmarks/bench_peer.py [--groups "autoregressive b1" ...] [--rounds 3] [--first-call]
[--max-quiet-wait 0] [--max-retries 1] [--append]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PEER = pathlib.Path("bench", "transformers_peer")


def peer_dir(given: str | None) -> pathlib.Path | None:
    """The peer benchmark's folder: ``given``, else ``shared/bench/transformers_peer`` beside the clone
    or beside one of its parent folders (a worktree's)."""
    if given:
        return pathlib.Path(given)
    for parent in ROOT.parents:
        if (parent / "shared" / PEER / "bench_vs_transformers.py").exists():
            return parent / "shared" / PEER
    return None


def missing(peer: pathlib.Path | None) -> str:
    """Why the benchmark cannot run here ("" when it can)."""
    if peer is None or not (peer / "bench_vs_transformers.py").exists():
        return "no shared/bench/transformers_peer beside the clone (pass --peer-dir)"
    torch_python = os.environ.get("PEER_TORCH_PYTHON", ".peer/torch-venv/bin/python")
    try:
        ok = subprocess.run([torch_python, "-c", "import torch, transformers"], capture_output=True,
                            timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        return f"torch and transformers are not importable by {torch_python} (run {peer / 'setup.sh'})"
    hf_dir = pathlib.Path(os.environ.get("PEER_HF_DIR", ".peer/hf"))
    if not (hf_dir / "target").is_dir():
        return f"no exported demo pair at {hf_dir} (run {peer / 'setup.sh'})"
    return ""


def load_driver(peer: pathlib.Path, max_retries: int):
    """The peer's driver module, its workers told to re-run a disturbed call at most ``max_retries`` times."""
    spec = importlib.util.spec_from_file_location("bench_vs_transformers", peer / "bench_vs_transformers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    call = module.Worker.call

    def bounded(self, **msg):
        if msg.get("cmd") == "pids":
            msg["retry"] = {**msg.get("retry", {}), "max_retries": max_retries}
        return call(self, **msg)

    module.Worker.call = bounded
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-dir")
    parser.add_argument("--groups", nargs="*", help="only these groups (titles as in the peer's GROUPS)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-call", action="store_true", help="a user's first call in fresh processes instead")
    parser.add_argument("--repeats", type=int, default=3, help="--first-call: processes per framework and mode")
    parser.add_argument("--profile", action="store_true", help="also time single steps / forwards")
    parser.add_argument("--max-quiet-wait", type=float, default=0.0)
    parser.add_argument("--max-retries", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".peer/bench")
    parser.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    peer = peer_dir(args.peer_dir)
    why = missing(peer)
    if why:
        print(f"bench_peer: skipped: {why}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    driver = load_driver(peer, args.max_retries)
    load_before = os.getloadavg()
    out = pathlib.Path(args.out)
    if args.first_call:
        (out / "results.json").unlink(missing_ok=True)
        driver.first_call(argparse.Namespace(out=args.out, repeats=args.repeats, max_quiet_wait=args.max_quiet_wait))
    else:
        (out / "first_call.json").unlink(missing_ok=True)
        driver.drive(argparse.Namespace(out=args.out, rounds=args.rounds, groups=args.groups, profile=args.profile,
                                        max_quiet_wait=args.max_quiet_wait, smoke=args.smoke))
    load_after = os.getloadavg()
    if args.first_call:
        tables = first_call_table(json.loads((out / "first_call.json").read_text()))
    else:
        summary = subprocess.run([sys.executable, str(peer / "summarize_bench.py"), args.out], capture_output=True,
                                 text=True, check=False)
        tables = summary.stdout
        if summary.returncode:        # the peer's summary stops early on some subsets of --groups
            last = (summary.stderr.strip().splitlines() or ["?"])[-1]
            tables += f"\n(summarize_bench.py stopped here: {last})\n"
        tables += identity_table(json.loads((out / "results.json").read_text()))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import publish
    details = (f"scv-jax at {commit}; 1/5/15-min load average before {'/'.join(f'{x:.2f}' for x in load_before)}, "
               f"after {'/'.join(f'{x:.2f}' for x in load_after)} (a machine shared with other jobs); a call re-run "
               f"at most {args.max_retries} time(s) when other processes used > 5% of a core during it. ")
    publish(__file__, "bench_peer: scv-jax vs Hugging Face transformers" + (", first call" if args.first_call else ""),
            details, tables, append=args.append, argv=argv)
    return 0


def identity_table(results: dict) -> str:
    """Each greedy configuration's sequences (warm-up and every round) against transformers' for the same
    prompt and length."""
    runs = [{k: v["calls"] for k, v in results["warmup"].items()}, *results["rounds"]]

    def sequences(name: str, record: dict):
        batch = 16 if name.endswith("_b16") else 4 if name.endswith("_b4") else 1
        for call in record[name]:
            for row, tokens in enumerate(call["tokens"]):
                yield (call["idx"] * batch + row, call["n"]), tokens

    greedy = sorted({n for r in runs for n in r if "sample" not in n})
    reference = {key: tokens for r in runs for n in greedy if n.startswith("hf") for key, tokens in sequences(n, r)}
    lines = ["\n### Greedy outputs against transformers' (same prompt and length)\n",
             "| configuration | sequences | identical to transformers' |", "|---|---:|---:|"]
    for name in greedy:
        pairs = [(t, reference.get(key)) for r in runs if name in r for key, t in sequences(name, r)]
        pairs = [(t, ref) for t, ref in pairs if ref is not None]
        lines.append(f"| {name} | {len(pairs)} | {sum(t == ref for t, ref in pairs)} |")
    return "\n".join(lines) + "\n"


def first_call_table(rows: list[dict]) -> str:
    """The peer's fresh-process runs, one row each (scv-jax's first process of a shape fills its
    persistent compilation cache, the later ones load from it)."""
    lines = ["| framework | mode | process | import s | load s | first generate s | second generate s "
             "| whole process s | scv-jax compile s (count), first generate | load average |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in sorted(rows, key=lambda r: (r["framework"], r["mode"], r["rep"])):
        cells = [row[k] for k in ("import_s", "load_s", "first_generate_s", "second_generate_s", "process_wall_s")]
        stats = row.get("stats")
        compiled = f"{stats[0]['compile_seconds']:.2f} ({stats[0]['compile_count']})" if stats else "-"
        lines.append(f"| {row['framework']} | {row['mode']} | {row['rep'] + 1} | "
                     + " | ".join(f"{c:.2f}" for c in cells) + f" | {compiled} | {row['loadavg'][0]:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
