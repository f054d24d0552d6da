"""Streaming load generator for an OpenAI-compatible ``/v1/completions`` endpoint.

Each request is sent with its prompt as token ids, ``temperature=0``, ``ignore_eos=true`` (so the
output has exactly ``max_tokens`` tokens), ``stream=true`` and ``stream_options.include_usage``.
The client timestamps every SSE chunk that carries text: the first gives TTFT, the gaps between
consecutive ones are the inter-token latencies (ITL). Prompt, cached and output token counts come
from the final usage chunk. Requests start open-loop at given arrival times, or closed-loop with a
fixed number in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from splitserve.bench.workloads import RequestSpec


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; ``start_s`` is from the start of the run.

    Attributes:
        ttft_s: send to first text chunk. itl_s: gaps between consecutive text chunks.
        e2e_s: send to end of stream. chunks: text chunks received.
        output_tokens / prompt_tokens / cached_tokens: from the usage chunk (chunks if absent).
        error: None on success, else a short description (HTTP status and message).
    """

    index: int
    kind: str
    max_tokens: int
    start_s: float = 0.0
    scheduled_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output_tokens - 1); None with fewer than two output tokens or on error."""
        if not self.ok or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s


def request_body(spec: RequestSpec, model: str) -> dict:
    """The JSON body sent for ``spec``."""
    return {
        "model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }


async def send_one(client: httpx.AsyncClient, spec: RequestSpec, model: str, t0: float, clock=time.perf_counter) -> RequestRecord:
    """Stream one request; never raises for HTTP or protocol errors (they land in ``error``)."""
    rec = RequestRecord(spec.index, spec.kind, spec.max_tokens, prompt_tokens=len(spec.prompt_token_ids))
    start = clock()
    rec.start_s = start - t0
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(spec, model)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                now = clock()
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    break
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.chunks += 1
                usage = obj.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        rec.e2e_s = clock() - start
        if rec.output_tokens == 0:
            rec.output_tokens = rec.chunks
        if rec.error is None and rec.ttft_s is None:
            rec.error = "no text chunk received"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_requests(
    url: str, model: str, specs: list[RequestSpec], *, arrivals_s: list[float] | None = None,
    concurrency: int | None = None, timeout_s: float = 600.0, progress: bool = True, desc: str = "bench",
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request; returns (records in workload order, run duration in s).

    Exactly one of ``arrivals_s`` (open loop: request i starts ``arrivals_s[i]`` s after the start)
    and ``concurrency`` (closed loop: that many in flight) must be given. The duration runs from
    the start to the last request's end. ``transport`` replaces the network (tests).

    Raises:
        ValueError: neither or both of arrivals_s / concurrency, or a length mismatch.
    """
    if (arrivals_s is None) == (concurrency is None):
        raise ValueError("give exactly one of arrivals_s and concurrency")
    if arrivals_s is not None and len(arrivals_s) != len(specs):
        raise ValueError(f"{len(arrivals_s)} arrival times for {len(specs)} requests")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    bar = _progress(len(specs), desc, progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    records: list[RequestRecord | None] = [None] * len(specs)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits, transport=transport) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            records[i] = await send_one(client, specs[i], model, t0)
            if arrivals_s is not None:
                records[i].scheduled_s = arrivals_s[i]
            bar.update(1)

        if arrivals_s is not None:
            tasks = []
            for i, at in enumerate(arrivals_s):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(range(len(specs)))

            async def worker() -> None:
                for i in queue:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    bar.close()
    done = [r for r in records if r is not None]
    end = max((r.end_s for r in done if r.end_s is not None), default=0.0)
    return done, end


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True, leave=False)
