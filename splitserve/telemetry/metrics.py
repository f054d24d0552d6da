"""Every Prometheus metric of splitserve, in one place.

Names follow the serving engines users already scrape (vLLM): a ``splitserve:`` prefix, seconds
and bytes as units, ``_total`` on counters, ``model_name`` on request-level metrics. Each process
serves the metrics it updates on its own ``GET /metrics`` (router: the HTTP port; workers:
``--metrics-port``); ``job``/``instance`` labels from the scraper tell the processes apart.

Metrics are created unregistered and grouped by role; a process exposes its groups with
:func:`expose` (the router shows no decode-worker histograms stuck at zero, and so on). Updating a
metric of a group that is not exposed is harmless.

Router (front end, also ``splitserve colocated``): TTFT, ITL, TPOT, end-to-end latency, requests by
outcome, prompt/cached/generated tokens, requests in flight, disaggregation decisions.
Workers: engine queues and KV blocks (:mod:`splitserve.telemetry.exposition`), prefill time,
prefix-cache queries/hits, decode queue/decode time, KV transfer bytes/latency/outcomes, KV leases.
KV store: lookups by result, evictions, put/get latency (:mod:`splitserve.telemetry.store`).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Buckets (seconds). vLLM's, extended downwards: a small model on a CPU decodes in milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                   20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0)

# --- router / front end (label model_name) -------------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    "splitserve:time_to_first_token_seconds", "Time from the request reaching the backend to its first token.",
    ["model_name"], buckets=TTFT_BUCKETS, registry=None)
INTER_TOKEN_LATENCY = Histogram(
    "splitserve:inter_token_latency_seconds", "Time between consecutive token deliveries of a request.",
    ["model_name"], buckets=ITL_BUCKETS, registry=None)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "splitserve:request_time_per_output_token_seconds",
    "TPOT per request: (end-to-end latency - TTFT) / (output tokens - 1).", ["model_name"], buckets=ITL_BUCKETS, registry=None)
E2E_LATENCY = Histogram(
    "splitserve:e2e_request_latency_seconds", "End-to-end request latency at the router.",
    ["model_name"], buckets=REQUEST_BUCKETS, registry=None)
REQUESTS = Counter(
    "splitserve:requests", "Finished requests by outcome: stop, length, abort (ended by the server), "
    "cancelled (client went away) or error.", ["model_name", "outcome"], registry=None)
PROMPT_TOKENS = Counter("splitserve:prompt_tokens", "Prompt tokens of requests served.", ["model_name"], registry=None)
PROMPT_TOKENS_CACHED = Counter(
    "splitserve:prompt_tokens_cached", "Prompt tokens served from a prefix cache.", ["model_name"], registry=None)
GENERATION_TOKENS = Counter("splitserve:generation_tokens", "Tokens generated.", ["model_name"], registry=None)
REQUESTS_IN_FLIGHT = Gauge(
    "splitserve:num_requests_in_flight", "Requests the router is serving now.", ["model_name"], registry=None)
DISAGG_DECISIONS = Counter(
    "splitserve:disagg_decisions", "Where each request was prefilled: remote_prefill (prefill worker, KV "
    "transferred) or local_prefill (on the decode worker).", ["decision"], registry=None)

# --- prefill worker ------------------------------------------------------------------------------------
PREFILL_TIME = Histogram(
    "splitserve:request_prefill_time_seconds", "Prefill of one request on a prefill worker (queue + forward).",
    buckets=REQUEST_BUCKETS, registry=None)
PREFIX_CACHE_QUERIES = Counter(
    "splitserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (hit rate = hits / queries).", registry=None)
PREFIX_CACHE_HITS = Counter("splitserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=None)
KV_LEASES_EXPIRED = Counter(
    "splitserve:kv_leases_expired", "KV holds freed because no decode worker pulled them in time.", registry=None)

# --- decode worker -------------------------------------------------------------------------------------
DECODE_QUEUE_TIME = Histogram(
    "splitserve:request_queue_time_seconds",
    "Decode worker: from handing the request to the engine until its first token there.", buckets=REQUEST_BUCKETS, registry=None)
DECODE_TIME = Histogram(
    "splitserve:request_decode_time_seconds", "Decode worker: from the first token there until the last.",
    buckets=REQUEST_BUCKETS, registry=None)
DECODE_REQUESTS = Counter(
    "splitserve:decode_requests", "Decode streams by outcome (stop, length, abort, cancelled, error).", ["outcome"], registry=None)
DECODE_TOKENS = Counter("splitserve:decode_generation_tokens", "Tokens generated by this decode worker.", registry=None)

# --- KV transfer (label direction: send | receive; path: host | cuda | staged) -----------------------------
KV_TRANSFER_TIME = Histogram(
    "splitserve:kv_transfer_seconds", "Duration of one KV transfer (receive: the whole pull; send: serving it).",
    ["direction", "transport", "path"], buckets=TRANSFER_BUCKETS, registry=None)
KV_TRANSFER_BYTES = Counter(
    "splitserve:kv_transfer_bytes", "KV cache bytes moved by successful transfers.", ["direction", "transport", "path"],
    registry=None)
KV_TRANSFERS = Counter(
    "splitserve:kv_transfers", "KV transfers by outcome (ok, error, cancelled).", ["direction", "transport", "path", "outcome"],
    registry=None)

# --- KV store (updated by the store service and its clients) --------------------------------------------
STORE_LOOKUPS = Counter(
    "splitserve:kv_store_lookups", "KV store block lookups by result (hit, miss); hit rate = hit / all.", ["result"], registry=None)
STORE_EVICTIONS = Counter("splitserve:kv_store_evictions", "Objects evicted from the KV store.", registry=None)
STORE_OP_TIME = Histogram(
    "splitserve:kv_store_op_seconds", "KV store put/get latency.", ["op"], buckets=TRANSFER_BUCKETS, registry=None)
STORE_BYTES = Counter("splitserve:kv_store_bytes", "KV bytes written to (put) or read from (get) the store.", ["op"], registry=None)

GROUPS: dict[str, tuple] = {
    "frontend": (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, REQUESTS, PROMPT_TOKENS,
                 PROMPT_TOKENS_CACHED, GENERATION_TOKENS, REQUESTS_IN_FLIGHT, DISAGG_DECISIONS),
    "prefill": (PREFILL_TIME, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, KV_LEASES_EXPIRED),
    "decode": (DECODE_QUEUE_TIME, DECODE_TIME, DECODE_REQUESTS, DECODE_TOKENS),
    "transfer": (KV_TRANSFER_TIME, KV_TRANSFER_BYTES, KV_TRANSFERS),
    "store": (STORE_LOOKUPS, STORE_EVICTIONS, STORE_OP_TIME, STORE_BYTES),
}
_exposed: dict[int, set[int]] = {}


def expose(*groups: str, registry: CollectorRegistry = REGISTRY) -> None:
    """Register the metrics of ``groups`` (keys of :data:`GROUPS`) on ``registry``; idempotent.

    Raises:
        ValueError: an unknown group name.
    """
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown metric groups {unknown}; known: {', '.join(GROUPS)}")
    done = _exposed.setdefault(id(registry), set())
    for group in groups:
        for metric in GROUPS[group]:
            if id(metric) not in done:
                registry.register(metric)
                done.add(id(metric))

# --- router: worker registry and routing decisions -----------------------------------------------------
ROUTER_WORKER_UP = Gauge(
    "splitserve:router_worker_up", "1 while the router routes to the worker (health checks pass), else 0.",
    ["role", "worker"], registry=None)
ROUTER_WORKER_PICKS = Counter(
    "splitserve:router_worker_picks", "Requests the routing policy sent to each worker.", ["role", "worker"], registry=None)
ROUTER_FAILOVERS = Counter(
    "splitserve:router_failovers", "Attempts moved to another worker (or to local prefill) after a worker failed before "
    "the first token.", ["role"], registry=None)
ROUTER_DECODE_MIGRATIONS = Counter(
    "splitserve:router_decode_migrations", "Choices whose decode stream moved to another decode worker after its "
    "worker failed mid-stream (reason: the failure's status code, or STALLED).", ["reason"], registry=None)
DISAGG_THRESHOLD = Gauge(
    "splitserve:disagg_threshold_tokens", "Current uncached-prompt-token threshold below which requests are prefilled "
    "on the decode worker (fixed or derived by the auto cost model).", registry=None)
DISAGG_PREFILL_SECONDS_PER_TOKEN = Gauge(
    "splitserve:disagg_prefill_seconds_per_token", "Measured prefill time per uncached token (regression slope) on "
    "prefill workers (where=remote) and on decode workers (where=local).", ["where"], registry=None)
DISAGG_TRANSFER_SECONDS_PER_TOKEN = Gauge(
    "splitserve:disagg_transfer_seconds_per_token", "Measured KV handoff time per prompt token (1 / bandwidth in tokens).",
    registry=None)
DISAGG_TRANSFER_OVERHEAD = Gauge(
    "splitserve:disagg_transfer_overhead_seconds", "Measured fixed cost of one KV handoff (regression intercept).", registry=None)
GROUPS["router"] = (ROUTER_WORKER_UP, ROUTER_WORKER_PICKS, ROUTER_FAILOVERS, ROUTER_DECODE_MIGRATIONS, DISAGG_THRESHOLD,
                    DISAGG_PREFILL_SECONDS_PER_TOKEN, DISAGG_TRANSFER_SECONDS_PER_TOKEN, DISAGG_TRANSFER_OVERHEAD)

# --- router: the planner (--planner; label role: prefill | decode) ---------------------------------------
PLANNER_DESIRED_WORKERS = Gauge(
    "splitserve:planner_desired_workers", "Workers each role needs for its load to meet its targets (max(1, ceil(workers x "
    "load))): the replica count an autoscaler (HPA, KEDA) can act on per role.", ["role"], registry=None)
PLANNER_WORKERS = Gauge("splitserve:planner_workers", "Workers up whose current role takes this work.", ["role"], registry=None)
PLANNER_LOAD = Gauge(
    "splitserve:planner_load", "The planner's load per kind of work: its worst signal over its target (1.0 = at target; "
    "TTFT or ITL over the SLO, queued prefill tokens or running decodes per worker over their targets).", ["role"], registry=None)
PLANNER_DECISIONS = Counter(
    "splitserve:planner_decisions", "Planner ticks by outcome: hold, wait (a want not held for the window yet), cooldown, "
    "no_candidate, flip, flip_failed.", ["action"], registry=None)
PLANNER_ROLE_SWITCHES = Counter(
    "splitserve:planner_role_switches", "Workers the planner switched, by the role left and the role taken.",
    ["from_role", "to_role"], registry=None)
GROUPS["planner"] = (PLANNER_DESIRED_WORKERS, PLANNER_WORKERS, PLANNER_LOAD, PLANNER_DECISIONS, PLANNER_ROLE_SWITCHES)
