"""Peer comparison (issue 13): splitserve colocated, splitserve disaggregated (1P+1D), vLLM's CPU build and
llama.cpp, one at a time on the same model, driven by the same client (``splitserve.bench``) with the same
workloads (benchmarks/peers/peer_suite.py). Prints the table with ratios and writes JSON to benchmarks/results/.

Nothing else may run on the machine: before each engine the runner waits (``--load-wait-s``) for the 1-minute
load average to fall to ``--max-load`` (0.5) and refuses to go on if it does not, unless ``--allow-busy``
(then every result is marked busy and a warning is printed). Each engine is stopped completely (its whole
process tree; stragglers are SIGKILLed and reported) before the next one starts.

Greedy everywhere: temperature 0 and ``ignore_eos`` (vLLM, splitserve); llama.cpp gets ``repeat_penalty`` 1.0
and relies on the model's zero EOS row to produce every requested token. A short greedy completion from each
engine is compared first (``greedy`` in the JSON).

    .venv/bin/python benchmarks/peers/run.py                     # every engine installed (install.sh)
    .venv/bin/python benchmarks/peers/run.py --engines splitserve-colocated,splitserve-disagg --quick --allow-busy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_engines as eng
import peer_suite as suite
from make_model import DEFAULT_OUT, NAME, make_model

from splitserve.bench.client import run_requests
from splitserve.bench.compare import warmup_specs
from splitserve.bench.metrics import summarize
from splitserve.bench.sysload import CpuWindow
from splitserve.paths import REPO_ROOT

GREEDY_PROMPT = "Once upon a time there was a little girl"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engines", default=",".join(eng.ENGINES), help="comma-separated subset of " + ", ".join(eng.ENGINES))
    ap.add_argument("--peers-home", type=Path, default=DEFAULT_OUT.parent, help="where install.sh put the peer venvs")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_OUT, help="where the model is (written by make_model.py if missing)")
    ap.add_argument("--threads", type=int, default=2, help="threads of vLLM and llama.cpp (splitserve uses its own defaults)")
    ap.add_argument("--splitserve-args", default="",
                    help="extra flags for `splitserve colocated`, given with '=' (e.g. --splitserve-args='--torch-threads 2')")
    ap.add_argument("--up-args", default="--no-store", help="extra flags for `splitserve up`, given with '='")
    ap.add_argument("--quick", action="store_true", help="a few short requests per workload (smoke test, not a measurement)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--max-load", type=float, default=0.5, help="highest 1-minute load average to start an engine at")
    ap.add_argument("--load-wait-s", type=float, default=180.0, help="how long to wait for the load to fall to --max-load")
    ap.add_argument("--allow-busy", action="store_true", help="measure anyway when the machine is busy (results are marked)")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0, help="longest engine start-up")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/peers-<time>.json)")
    a = ap.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    unknown = [e for e in a.engines if e not in eng.ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {unknown}; known: {', '.join(eng.ENGINES)}")
    if a.threads < 1:
        ap.error("--threads must be >= 1")
    return a


class Busy(RuntimeError):
    """The machine stayed busy and ``--allow-busy`` was not given; the message says so."""


def wait_for_quiet(max_load: float, wait_s: float, allow_busy: bool) -> tuple[float, bool]:
    """Wait until the 1-minute load average is <= ``max_load``; returns (load, busy).

    Raises:
        Busy: still busy after ``wait_s`` and not ``allow_busy``.
    """
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        print(f"  load average {load:.2f} > {max_load}: waiting for the machine to be quiet ...", flush=True)
        time.sleep(10)
        load = os.getloadavg()[0]
    if load <= max_load:
        return load, False
    banner = (f"!!! 1-minute load average {load:.2f} > {max_load}: something else is running on this machine. "
              "Numbers measured now are not comparable (see `top`). !!!")
    if not allow_busy:
        raise Busy(banner + "\nRefusing to measure; stop the other work, or pass --allow-busy to measure anyway.")
    print("\n" + banner + "\n(--allow-busy: measuring anyway; the results are marked busy)\n", file=sys.stderr, flush=True)
    return load, True


def ensure_model(model_dir: Path) -> tuple[Path, Path]:
    hf_dir, gguf = model_dir / NAME, model_dir / f"{NAME}.gguf"
    if not (hf_dir / "model.safetensors").is_file() or not gguf.is_file():
        print(f"writing the model to {model_dir} (make_model.py) ...", flush=True)
        make_model(model_dir, 0)
    return hf_dir, gguf


def greedy_text(engine: eng.Engine, transport: eng.RewritingTransport) -> str:
    """A 24-token greedy completion of GREEDY_PROMPT (non-streaming), as the engine's own text."""
    import httpx

    body = transport.rewrite({"model": engine.served, "prompt": GREEDY_PROMPT, "max_tokens": 24, "temperature": 0,
                              "ignore_eos": True})
    resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


async def drive(engine: eng.Engine, spec: suite.Spec, warm_spec: suite.Spec, decode, pids: list[int]) -> dict:
    """Warm up with ``warm_spec``'s first requests (other prompts: no prefix-cache hits on the measured ones), then
    run ``spec``; returns the summary, the table's metrics and CPU use. (Each client run closes its transport, so
    each gets a fresh one.)"""
    warm = warmup_specs(warm_spec.workload, n=min(3, spec.concurrency + 1))
    await run_requests(engine.url, engine.served, warm, concurrency=len(warm), progress=False,
                       transport=eng.RewritingTransport(engine, decode))
    window = CpuWindow.start(pids + [os.getpid()])
    records, duration = await run_requests(engine.url, engine.served, spec.workload.requests, concurrency=spec.concurrency,
                                           progress=False, desc=f"{engine.name}/{spec.key}",
                                           transport=eng.RewritingTransport(engine, decode))
    cpu = window.stop()
    summary = summarize(records, duration)
    failed = [r.error for r in records if r.error]
    return {"title": spec.title, "workload": spec.workload.info, "concurrency": spec.concurrency, "summary": summary,
            "metrics": suite.metrics(summary), "cpu": cpu, "first_error": failed[0] if failed else None}


def run_engine(engine: eng.Engine, specs: list[suite.Spec], warm_specs: list[suite.Spec], decode, log_dir: Path,
               a: argparse.Namespace) -> dict:
    """Start, check, measure and stop one engine; returns its JSON record."""
    load, busy = wait_for_quiet(a.max_load, a.load_wait_s, a.allow_busy)
    out: dict = {"command": " ".join(engine.argv), "env": engine.env, "load_before": load, "busy": busy, "runs": {}}
    print(f"\n== {engine.name}: starting (load {load:.2f}) ...", flush=True)
    eng.start(engine, log_dir / f"{engine.name}.log")
    try:
        out["startup_s"] = round(eng.wait_ready(engine, a.ready_timeout_s), 1)
        out["greedy"] = greedy_text(engine, eng.RewritingTransport(engine, decode))
        print(f"   ready in {out['startup_s']} s; greedy: {out['greedy']!r}", flush=True)
        pids = eng.process_tree(engine.proc.pid)
        for spec, warm_spec in zip(specs, warm_specs):
            if engine.single_stream_only and spec.concurrency > 1:
                continue
            r = asyncio.run(drive(engine, spec, warm_spec, decode, pids))
            m, cpu = r["metrics"], r["cpu"]
            print(f"   {spec.key}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items() if v is not None)
                  + f"; foreign cores {cpu['foreign_cores']}" + (f"; FIRST ERROR {r['first_error']}" if r["first_error"] else ""),
                  flush=True)
            out["runs"][spec.key] = r
    except Exception as exc:  # one engine failing must not stop the others; the log says why
        out["error"] = f"{type(exc).__name__}: {exc} (log: {log_dir / (engine.name + '.log')})"
        print(f"   FAILED: {out['error']}", flush=True)
    finally:
        killed = eng.stop(engine)
        out["killed_after_grace"] = killed
        print("   stopped cleanly" if not killed else f"   WARNING: had to SIGKILL {killed}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from splitserve.model import load_model
    from splitserve.model.synthetic import plain_token_ids

    hf_dir, gguf = ensure_model(a.model_dir)
    tokenizer = load_model(hf_dir, weights=False).tokenizer
    vocab = plain_token_ids(tokenizer)
    specs, warm_specs = suite.build(vocab, a.seed, a.quick), suite.build(vocab, a.seed + 1, a.quick)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = REPO_ROOT / "bench-out" / f"peers-{stamp}"
    report: dict = {"time": stamp, "quick": a.quick, "model": {"hf": str(hf_dir), "gguf": str(gguf)}, "cpus": os.cpu_count(),
                    "threads_peers": a.threads, "workloads": {s.key: s.title for s in specs}, "engines": {}, "skipped": {}}
    ran = []
    for name in a.engines:
        engine = eng.build(name, hf_dir=hf_dir, gguf=gguf, peers_home=a.peers_home, threads=a.threads, served=NAME,
                           splitserve_args=a.splitserve_args.split(), up_args=a.up_args.split())
        if isinstance(engine, str):
            print(f"\n== {name}: skipped: {engine}", flush=True)
            report["skipped"][name] = engine
            continue
        try:
            report["engines"][name] = run_engine(engine, specs, warm_specs, lambda ids: tokenizer.decode(ids), log_dir, a)
        except Busy as exc:  # nothing of this engine started; keep what the others measured
            print(str(exc), file=sys.stderr, flush=True)
            report["refused"] = {"engine": name, "why": str(exc).splitlines()[0]}
            break
        ran.append(name)
    greedy = {n: r["greedy"].strip() for n, r in report["engines"].items() if r.get("greedy") is not None}
    report["greedy_agree"] = len(set(greedy.values())) <= 1
    results = {n: {k: run["metrics"] for k, run in r["runs"].items()} for n, r in report["engines"].items()}
    text = suite.table(results, ran)
    report["table_md"] = text
    out = a.out or REPO_ROOT / "benchmarks" / "results" / f"peers-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n" + "\n".join(f"- {s.key}: {s.title}" for s in specs) + "\n\n" + text + "\n")
    print("greedy completions " + ("agree" if report["greedy_agree"] else "DIFFER: " + json.dumps(greedy, indent=1)))
    if any(r.get("busy") for r in report["engines"].values()):
        print("WARNING: the machine was busy during this run (--allow-busy); do not quote these numbers.")
    print(f"JSON: {out}\nserver logs: {log_dir}")
    failed = [n for n, r in report["engines"].items() if r.get("error") or r.get("killed_after_grace")
              or any(run["summary"]["errors"] for run in r["runs"].values())]
    return 1 if failed or "refused" in report else 0


if __name__ == "__main__":
    sys.exit(main())
