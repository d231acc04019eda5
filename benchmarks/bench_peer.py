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
    tables = subprocess.run([sys.executable, str(peer / "summarize_bench.py"), args.out], capture_output=True,
                            text=True, check=False).stdout if (out / "results.json").exists() else ""
    if args.first_call:
        tables = first_call_table(json.loads((out / "first_call.json").read_text()))
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


def first_call_table(rows: list[dict]) -> str:
    """Median seconds per framework and mode of the peer's fresh-process runs."""
    import statistics
    lines = ["| framework | mode | import s | load s | first generate s | second generate s | whole process s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for fw in ("hf", "jax"):
        for mode in ("ar", "spec"):
            sel = [r for r in rows if r["framework"] == fw and r["mode"] == mode]
            if sel:
                cells = [statistics.median(r[k] for r in sel) for k in
                         ("import_s", "load_s", "first_generate_s", "second_generate_s", "process_wall_s")]
                lines.append(f"| {fw} | {mode} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + f"\n\n{len(rows)} processes, load average at their starts " + ", ".join(
        f"{r['loadavg'][0]:.2f}" for r in rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
