"""What a huge prompt does to everyone else: event-loop stalls while it is prepared, and how fast it is refused.

One run, one process, the HTTP app in-process (ASGI) with the embedded TinyStories tokenizer and a
scripted backend (no model): a ``/health`` probe runs every 5 ms while one big completion request
(``--mb`` MB of prompt text) is parsed and tokenized. Three ways of preparing it:

* ``inline``        -- on the event loop (what the router did before);
* ``thread+encode`` -- in a worker thread, tokenizing with ``Tokenizer.encode`` (holds the GIL);
* ``thread+batch``  -- in a worker thread with ``encode_batch`` (releases the GIL): what ships;
* ``... gc frozen`` -- the same after ``gc.freeze()``: the worst probe left in ``thread+batch`` is a full
  garbage collection of the ~200k objects a process has after importing torch (0.4-1 s on a 2-core
  machine), which happens with or without any tokenizing; freezing them after start-up removes it.

For each: the big request's latency and the probes' worst and median latency during it, counted
from when each probe was due (a stalled loop makes probes late). Then the time
to refuse the same prompt against the real context length (512 tokens) with the character pre-check,
and without it (tokenize, then compare).

    python benchmarks/prep_offload.py [--mb 6]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import statistics
import time

import httpx

from splitserve.frontend.http_app import build_app
from splitserve.frontend.offload import Offload
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo
from splitserve.model import Tokenizer, load_model
from splitserve.paths import default_model_path


class _Inline(Offload):
    async def run(self, size, fn, *args):
        return fn(*args)


class _HoldsGil(Tokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_special_tokens and self.add_bos_token else ids


def _tokenizer(cls: type) -> Tokenizer:
    tok = copy.copy(load_model(default_model_path(), weights=False).tokenizer)
    tok.__class__ = cls
    return tok


async def _stall(app, prompt: str) -> tuple[float, float, float, int]:
    """The big request's latency; the worst and median /health latency counted from when each probe was
    due (one every 5 ms; a loop that cannot run makes the probe late); the number of probes answered."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=600) as c:
        probes: list[float] = []
        big = asyncio.create_task(c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
        t0 = time.perf_counter()
        while not big.done():
            due = time.perf_counter() + 0.005
            await asyncio.sleep(0.005)
            await c.get("/health")
            probes.append(time.perf_counter() - due)
        r = await big
        assert r.status_code == 200, r.text[:200]
        return time.perf_counter() - t0, max(probes), statistics.median(probes), len(probes)


async def _refuse(app, prompt: str) -> float:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=600) as c:
        t = time.perf_counter()
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]
        return time.perf_counter() - t


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=6.0, help="prompt size, MB")
    a = ap.parse_args()
    unit = "Once upon a time, there was a little girl named Lily. "
    prompt = unit * int(a.mb * 1e6 / len(unit))
    backend = ScriptedBackend(script=[300, 301, 302, 303])
    fits = 10_000_000  # a context that fits the prompt, so it is tokenized
    print(f"prompt: {len(prompt) / 1e6:.1f} M characters; /health probed every 5 ms while it is prepared\n")
    print(f"{'mode':<15} {'big request s':>14} {'probe max ms':>13} {'probe p50 ms':>13} {'probes':>7}")
    for name, tok, offload in (
        ("inline", _tokenizer(_HoldsGil), _Inline()),
        ("thread+encode", _tokenizer(_HoldsGil), Offload()),
        ("thread+batch", _tokenizer(Tokenizer), Offload()),
        ("... gc frozen", _tokenizer(Tokenizer), Offload()),
    ):
        if name == "... gc frozen":
            gc.collect()
            gc.freeze()
        app = build_app(SimpleModelInfo("m", tok, fits), backend, offload=offload)
        total, worst, median, n = await _stall(app, prompt)
        print(f"{name:<15} {total:>14.2f} {worst * 1e3:>13.1f} {median * 1e3:>13.2f} {n:>7}")
    tok = _tokenizer(Tokenizer)
    real = build_app(SimpleModelInfo("m", tok, 512), backend)
    no_check = build_app(SimpleModelInfo("m", tok, 512), backend)
    for route in no_check.routes:  # the same app with the pre-check disabled
        api = getattr(getattr(route, "endpoint", None), "__self__", None)
        if api is not None:
            api.prompt_limit.max_chars = None
    print(f"\nrefusing it at max_model_len 512: with the pre-check {await _refuse(real, prompt) * 1e3:.1f} ms, "
          f"tokenizing first {await _refuse(no_check, prompt) * 1e3:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())
