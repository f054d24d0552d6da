"""Flags and entry points of ``splitserve bench`` (one endpoint), ``bench compare`` and ``bench efficiency``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from splitserve.cli_help import new_parser
from splitserve.dtypes import DTYPE_CHOICES
from splitserve.env import env_choice, env_str
from splitserve.bench import arrivals as arr
from splitserve.bench import workloads as wl
from splitserve.bench.metrics import SLO
from splitserve.bench.report import RunResult, comparison_table, workload_line, write_results
from splitserve.paths import REPO_ROOT

TRACES = REPO_ROOT / "benchmarks" / "traces"  # shipped with their sources and licenses (SOURCES.md there)
DEFAULT_COMPARE_MODEL = "synthetic:llama-25m"
DEFAULT_TRACES = {"mooncake": TRACES / "mooncake_fast25_synthetic_trace.jsonl", "azure": TRACES / "azure_llm_2023_code.csv"}

USAGE = """splitserve bench [run options]          benchmark a running OpenAI-compatible endpoint (--url)
splitserve bench compare [options]      colocated (unchunked, chunked) vs disaggregated, one after another
splitserve bench efficiency [options]   decode step vs memory-bandwidth bound, prefill vs matmul peak
"""


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=env_str("PD_MODEL") or None,
                    help="model path or synthetic:NAME (its tokenizer builds prompts; its name is the request's model); "
                         "default: bench, the model the endpoint serves (GET /v1/models); compare, " + DEFAULT_COMPARE_MODEL)
    ap.add_argument("--served-model-name", help="model name the server answers to (default: from --model)")
    ap.add_argument("--workload", choices=["mixed", "fixed", "mooncake", "azure"], default="mixed",
                    help="mixed: interactive chats and documents; fixed: one prompt/output size; mooncake, azure: trace replay")
    ap.add_argument("--num-requests", type=int, default=60, help="requests (for traces: the most to replay)")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    g = ap.add_argument_group("synthetic workloads")
    g.add_argument("--document-every", type=int, default=4, help="mixed: every N-th request after the first 8 is a document")
    g.add_argument("--interactive-prompt", type=_range, default="32:128", help="mixed: interactive prompt tokens, LO:HI")
    g.add_argument("--interactive-output", type=_range, default="96:160", help="mixed: interactive output tokens, LO:HI")
    g.add_argument("--document-prompt", type=_range, default="1024:1536", help="mixed: document prompt tokens, LO:HI")
    g.add_argument("--document-output", type=_range, default="8:16", help="mixed: document output tokens, LO:HI")
    g.add_argument("--prompt-tokens", type=int, default=128, help="fixed: prompt tokens")
    g.add_argument("--output-tokens", type=int, default=64, help="fixed: output tokens")
    t = ap.add_argument_group("trace replay")
    t.add_argument("--trace", help="trace file (default: the mooncake/azure file in benchmarks/traces)")
    t.add_argument("--trace-start", type=int, default=0, help="first trace record to replay")
    t.add_argument("--input-scale", type=float, help="divide prompt lengths by this (mooncake 32, azure 4 by default)")
    t.add_argument("--output-scale", type=float, default=1.0, help="divide output lengths by this")
    t.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times by this (>1 = slower arrivals)")
    a = ap.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=["poisson", "gamma", "trace", "concurrency"],
                   help="default: trace for trace workloads, poisson otherwise")
    a.add_argument("--rate", type=float, default=2.0, help="poisson/gamma: requests per second")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    a.add_argument("--concurrency", type=int, default=8, help="concurrency: requests in flight")
    s = ap.add_argument_group("SLOs and output")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput (ms)")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput (ms)")
    s.add_argument("--out", help="output folder (default bench-out/<name>-<time>)")
    s.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout, seconds")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_tokenizer_info(model: str):
    from splitserve.model import load_model

    return load_model(model, weights=False)


def build_workload(a: argparse.Namespace, lm) -> wl.Workload:
    """The workload the flags describe (prompts from ``lm``'s plain token ids)."""
    from splitserve.model.synthetic import plain_token_ids

    vocab = plain_token_ids(lm.tokenizer)
    if a.workload == "mixed":
        return wl.synthetic_mixed(vocab, a.num_requests, a.seed, document_every=a.document_every,
                                  interactive_prompt=a.interactive_prompt, interactive_output=a.interactive_output,
                                  document_prompt=a.document_prompt, document_output=a.document_output)
    if a.workload == "fixed":
        return wl.synthetic_fixed(vocab, a.num_requests, a.seed, a.prompt_tokens, a.output_tokens)
    path = trace_path(a)
    build = wl.mooncake if a.workload == "mooncake" else wl.azure
    scale = a.input_scale or (32.0 if a.workload == "mooncake" else 4.0)
    return build(path, vocab, a.seed, input_scale=scale, output_scale=a.output_scale, time_scale=a.time_scale,
                 max_requests=a.num_requests, start=a.trace_start, max_model_len=lm.max_model_len)


def trace_path(a: argparse.Namespace) -> Path | None:
    """The trace file of a trace workload (None for synthetic ones); exits with one line if it is missing."""
    if a.workload not in DEFAULT_TRACES:
        return None
    path = Path(a.trace) if a.trace else DEFAULT_TRACES[a.workload]
    if not path.is_file():
        raise SystemExit(f"splitserve bench: error: no trace file at {path} (the {a.workload} trace ships in benchmarks/traces; "
                         "or give --trace FILE)")
    return path


def arrival_plan(a: argparse.Namespace, workload: wl.Workload) -> tuple[list[float] | None, int | None, str]:
    """(arrival times or None, concurrency or None, description)."""
    kind = a.arrival or ("trace" if workload.arrivals_s is not None else "poisson")
    n = len(workload.requests)
    if kind == "trace":
        if workload.arrivals_s is None:
            raise SystemExit("--arrival trace needs a trace workload (mooncake or azure)")
        return workload.arrivals_s, None, f"trace timestamps × time_scale {workload.info.get('time_scale')}"
    if kind == "concurrency":
        return None, a.concurrency, f"fixed concurrency {a.concurrency}"
    if kind == "gamma":
        return arr.gamma(a.rate, n, a.seed, a.burstiness), None, f"gamma rate {a.rate}/s burstiness {a.burstiness} seed {a.seed}"
    return arr.poisson(a.rate, n, a.seed), None, f"poisson rate {a.rate}/s seed {a.seed}"


def served_name(a: argparse.Namespace) -> str:
    return a.served_model_name or Path(a.model).name.removesuffix(".gguf")


def _header(a: argparse.Namespace, workload: wl.Workload, arrival: str) -> dict:
    return {"model": a.model, "arrivals": arrival, "slo_ttft_ms": a.slo_ttft_ms, "slo_tpot_ms": a.slo_tpot_ms,
            "command": "splitserve " + " ".join(sys.argv[1:]) if sys.argv and "bench" in sys.argv else None,
            "cpus": os.cpu_count()}


def run_main(argv: list[str]) -> int:
    """``splitserve bench``: one endpoint."""
    from splitserve.bench.client import run_requests

    ap = new_parser("splitserve bench", "Benchmark an OpenAI-compatible endpoint.", epilog=USAGE)
    ap.add_argument("--url", default=env_str("PD_BENCH_URL", "http://127.0.0.1:8000"), help="server base URL")
    ap.add_argument("--label", default="server", help="name of this configuration in the report")
    add_workload_args(ap)
    a = ap.parse_args(argv)
    trace_path(a)
    served = _served_model(a)
    lm = load_tokenizer_info(a.model)
    workload = build_workload(a, lm)
    context = min(lm.max_model_len, served.max_model_len or lm.max_model_len)
    workload, cut = wl.fit_to_context(workload, context)
    arrivals_s, concurrency, arrival = arrival_plan(a, workload)
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    print(f"model: {served_name(a)} ({a.model}), context {context} tokens"
          + (f"; {cut} requests cut to fit it" if cut else ""), flush=True)
    print(f"workload: {workload_line(workload)}\narrivals: {arrival}", flush=True)
    records, duration = asyncio.run(run_requests(a.url, served_name(a), workload.requests, arrivals_s=arrivals_s,
                                                 concurrency=concurrency, timeout_s=a.timeout_s, progress=not a.no_progress,
                                                 desc=a.label))
    result = RunResult(a.label, records, duration, slo, {"url": a.url})
    out = Path(a.out) if a.out else _default_out(workload.name)
    paths = write_results(out, workload, [result], _header(a, workload, arrival))
    print(comparison_table([result]))
    print("\n" + "\n".join(f"{k}: {p}" for k, p in paths.items()))
    failed = [r for r in records if r.error is not None]
    if failed:
        print(f"\n{len(failed)} of {len(records)} requests failed; the first: {failed[0].error}", flush=True)
    return 0 if result.summary["errors"] == 0 else 1


def _served_model(a: argparse.Namespace):
    """Ask the endpoint what it serves; without ``--model``, use the shipped model of that name (one-line exit if none)."""
    from splitserve.bench.served import EndpointError, local_model_for, served_model

    try:
        served = served_model(a.url)
    except EndpointError as exc:
        raise SystemExit(f"splitserve bench: error: {exc}") from None
    if a.model is None:
        local = local_model_for(served.name)
        if local is None:
            raise SystemExit(f"splitserve bench: error: {a.url} serves {served.name!r}, which is not a shipped model; "
                             "give --model PATH (the model folder or GGUF file: its tokenizer builds the prompts)")
        a.model = str(local)
        a.served_model_name = a.served_model_name or served.name
    return served


def compare_main(argv: list[str]) -> int:
    """``splitserve bench compare``: every configuration in turn, one table."""
    from splitserve.bench.compare import CONFIGS, ServerSettings, run_config, targets

    ap = new_parser("splitserve bench compare",
                    "Run one workload on colocated (unchunked, chunked) and disaggregated servers in turn.")
    add_workload_args(ap)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="chunked prefill: token budget per step")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="KV block pool of each server, MiB")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    ap.add_argument("--colocated-cpus", default="0,1", help="CPUs of the colocated server (torch threads = their count)")
    ap.add_argument("--prefill-cpus", default="0", help="CPUs of the prefill worker (taskset list)")
    ap.add_argument("--decode-cpus", default="1", help="CPUs of the decode worker (taskset list)")
    ap.add_argument("--skip-efficiency", action="store_true", help="do not measure engine efficiency first")
    ap.add_argument("--nice", type=int, default=None,
                    help="nice value for the servers and this client (e.g. -10 on a shared machine; negative needs root)")
    a = ap.parse_args(argv)
    a.model = a.model or DEFAULT_COMPARE_MODEL
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    lm = load_tokenizer_info(a.model)
    workload = build_workload(a, lm)
    arrivals_s, concurrency, arrival = arrival_plan(a, workload)
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    settings = ServerSettings(model=a.model, kv_cache_mb=a.kv_cache_mb, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                              max_num_batched_tokens=a.max_num_batched_tokens, colocated_cpus=a.colocated_cpus,
                              prefill_cpus=a.prefill_cpus, decode_cpus=a.decode_cpus, nice=a.nice)
    if a.nice is not None:
        from splitserve.bench.pin import set_nice

        set_nice(a.nice)
    print(f"workload: {workload_line(workload)}\narrivals: {arrival}\nconfigs: {', '.join(configs)}", flush=True)
    efficiency_md = ""
    if not a.skip_efficiency:
        efficiency_md = efficiency_report(a.model)
        print(efficiency_md, flush=True)
    results = []
    for config in configs:
        r = run_config(config, settings, workload, served_name(a), arrivals_s=arrivals_s, concurrency=concurrency, slo=slo,
                       progress=not a.no_progress, timeout_s=a.timeout_s)
        s = r.summary
        print(f"{config}: {s['completed']}/{s['requests']} ok, ITL p99 {s['itl_ms']['p99']} ms, goodput {s['goodput_rps']:.3f} req/s, "
              f"cpu {r.meta['cpu']}", flush=True)
        results.append(r)
    target_lines = targets(workload, results)
    cpu_lines = [f"- {r.config}: " + ", ".join(f"{k}={v}" for k, v in r.meta["cpu"].items()) for r in results]
    cmd_lines = [f"- {r.config}: `" + "`; `".join(r.meta["commands"]) + "`" for r in results]
    extra = "\n".join(["## Targets", *(f"- {t}" for t in target_lines), "", "## CPU use during each run (other processes = foreign)",
                       *cpu_lines, "", "## Server commands", *cmd_lines, "", efficiency_md])
    header = {**_header(a, workload, arrival), "configs": configs, "chunked_budget_tokens": a.max_num_batched_tokens,
              "colocated_cpus": a.colocated_cpus, "prefill_cpus": a.prefill_cpus, "decode_cpus": a.decode_cpus, "nice": a.nice}
    out = Path(a.out) if a.out else _default_out(f"compare-{workload.name}")
    paths = write_results(out, workload, results, header, extra)
    print("\n" + comparison_table(results) + "\n")
    print("\n".join(target_lines))
    print("\n" + "\n".join(f"{k}: {p}" for k, p in paths.items()))
    return 0


def efficiency_report(model: str) -> str:
    from splitserve.bench.efficiency import format_rows, measure
    from splitserve.model import load_model

    return format_rows(measure(load_model(model)), model)


def efficiency_main(argv: list[str]) -> int:
    """``splitserve bench efficiency``."""
    from splitserve.bench.efficiency import format_rows, measure
    from splitserve.engine.device import DEVICE_HELP, check_device_available
    from splitserve.model import load_model

    ap = new_parser("splitserve bench efficiency", "Engine efficiency vs this CPU's limits.")
    ap.add_argument("--model", default=env_str("PD_MODEL", "synthetic:llama-25m"), help="model folder, .gguf file or synthetic:NAME")
    ap.add_argument("--threads", default="1,2", help="torch thread counts to measure")
    ap.add_argument("--batch", type=int, default=8, help="decode batch size")
    ap.add_argument("--context", type=int, default=512, help="decode context tokens per sequence")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--dtype", default=env_choice("PD_DTYPE", DTYPE_CHOICES, "auto"), choices=DTYPE_CHOICES,
                    help="weights and KV cache dtype (auto: the checkpoint's; env PD_DTYPE)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--device", default=env_str("PD_DEVICE", "cpu"), help=f"where to measure: {DEVICE_HELP}")
    a = ap.parse_args(argv)
    try:
        check_device_available(a.device)
    except ValueError as exc:
        ap.error(str(exc))
    rows = measure(load_model(a.model, a.dtype, device=a.device), tuple(int(t) for t in a.threads.split(",")), a.batch, a.context, a.prompt)
    print(json.dumps(rows, indent=1) if a.json else format_rows(rows, a.model))
    return 0


def _default_out(name: str) -> Path:
    from splitserve.bench.compare import outputs_dir

    return outputs_dir(None, name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[2:] if argv is None else argv
    if argv and argv[0] == "compare":
        sys.exit(compare_main(argv[1:]))
    if argv and argv[0] == "efficiency":
        sys.exit(efficiency_main(argv[1:]))
    sys.exit(run_main(argv))
