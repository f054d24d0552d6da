"""Disaggregated == colocated, token for token and logprob for logprob, with every sampling parameter set (issue 14),
at temperature 0 and with a seed, n > 1 included: through the router (remote prefill; local prefill on the decode
worker; a failed KV pull recomputed on the decode worker) and through the gRPC front door, against the same engine's
``generate`` (the colocated path). One prefill and one KV transfer serve all n choices, and every block comes back.

Needs the engine's n-choice API (``PrefillOutput.first_token_ids``, ``decode_prefilled(..., first_token_ids)``):
skipped on an engine without it.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from splitserve.client import RouterClient
from splitserve.engine.sampling import SamplingParams
from splitserve.services.router.disaggregation import DisaggregationPolicy
from tests.inproc_cluster import InprocCluster


PROMPT = "Once upon a time there was a little girl named Lily. She liked to play in the park with her"


def every_parameter(greedy_tokens: list[int], **kw) -> SamplingParams:
    """Every logit-shaping parameter set, aimed at tokens the unconstrained greedy output uses, so each one matters."""
    a, b, c = greedy_tokens[1], greedy_tokens[2], greedy_tokens[3]
    return SamplingParams(
        max_tokens=20, ignore_eos=True, top_k=40, top_p=0.95, stop_token_ids=(c,), presence_penalty=0.6,
        frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.02, min_tokens=8, logit_bias=((a, -4.0), (b, 1.5)),
        bad_words_token_ids=((greedy_tokens[4], greedy_tokens[5]), (greedy_tokens[6],)), logprobs=3, prompt_logprobs=2,
        **kw,
    )


def by_choice(outputs) -> dict:
    """``{index: (token ids, logprobs, finish_reason)}`` and the prompt logprobs, from RequestOutputs or TokenEvents."""
    tokens, lps, finish, prompt = defaultdict(list), defaultdict(list), {}, None
    for o in outputs:
        tokens[o.index] += o.token_ids
        lps[o.index] += o.logprobs or []
        if o.finish_reason is not None:
            finish[o.index] = o.finish_reason
        if o.prompt_logprobs is not None:
            assert prompt is None, "prompt logprobs come once"
            prompt = o.prompt_logprobs
    return {i: (tokens[i], lps[i], finish.get(i)) for i in sorted(tokens)}, prompt


def assert_same_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


def assert_same(got, want) -> None:
    (gc, gp), (wc, wp) = got, want
    assert {i: (t, f) for i, (t, _, f) in gc.items()} == {i: (t, f) for i, (t, _, f) in wc.items()}
    for i in wc:
        assert_same_logprobs(gc[i][1], wc[i][1])
    assert_same_logprobs(gp, wp)


@pytest.fixture
async def cluster(lm):
    c = await InprocCluster(lm).start()
    yield c
    await c.stop()


async def colocated(c: InprocCluster, prompt: list[int], params: SamplingParams, rid: str):
    return by_choice([o async for o in c.decode[0].engine.generate(rid, prompt, params)])


async def routed(c: InprocCluster, prompt: list[int], params: SamplingParams, rid: str):
    return by_choice([ev async for ev in c.backend.generate(rid, prompt, params)])


@pytest.fixture
async def greedy_tokens(lm, cluster):
    prompt = lm.tokenizer.encode(PROMPT)
    (choices, _) = await colocated(cluster, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "g")
    return choices[0][0]


@pytest.mark.parametrize("case", ["greedy", "seeded", "seeded-allowed"])
@pytest.mark.parametrize("path", ["remote-prefill", "local-prefill"])
async def test_disaggregated_equals_colocated_with_every_sampling_parameter(lm, cluster, greedy_tokens, case, path):
    prompt = lm.tokenizer.encode(PROMPT)
    params = {
        "greedy": every_parameter(greedy_tokens, temperature=0.0, n=2),
        "seeded": every_parameter(greedy_tokens, temperature=0.8, seed=1234, n=3),
        "seeded-allowed": every_parameter(greedy_tokens, temperature=1.0, seed=7, n=2,
                                          allowed_token_ids=tuple(sorted(set(range(50, 600)) | set(greedy_tokens)))),
    }[case]
    want = await colocated(cluster, prompt, params, f"col-{case}-{path}")
    assert len(want[0]) == params.n and all(len(t) == params.max_tokens or f == "stop" for t, _, f in want[0].values())
    assert want[1] is not None and want[1][0] is None and len(want[1]) == len(prompt)
    if case == "greedy":  # n choices at temperature 0 are equal
        assert len({tuple(t) for t, _, _ in want[0].values()}) == 1
    before = {k: dict(v) for k, v in (await cluster.read_stats())[0].items()}
    cluster.backend.disagg = DisaggregationPolicy("always" if path == "remote-prefill" else "1000000")
    got = await routed(cluster, prompt, params, f"dis-{case}-{path}")
    assert_same(got, want)
    after = (await cluster.read_stats())[0]
    if path == "remote-prefill":  # one prefill and one KV transfer for all n choices
        assert after["prefill-0"]["requests"] - before["prefill-0"]["requests"] == 1
        assert after["decode-0"]["kv_transfers_ok"] - before["decode-0"]["kv_transfers_ok"] == 1
    await cluster.wait_idle(timeout_s=2.0)


async def test_grpc_front_door_equals_colocated(lm, cluster, greedy_tokens):
    prompt = lm.tokenizer.encode(PROMPT)
    params = every_parameter(greedy_tokens, temperature=0.7, seed=99, n=3)
    want, want_prompt = await colocated(cluster, prompt, params, "col-grpc")
    tokens, lps = defaultdict(list), defaultdict(list)
    async with RouterClient(cluster.router_address) as client:
        msgs = [m async for m in client.generate(
            prompt, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed, stop_token_ids=list(params.stop_token_ids), ignore_eos=True, n=3, logprobs=3,
            prompt_logprobs=2, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, min_p=params.min_p, min_tokens=params.min_tokens,
            logit_bias=dict(params.logit_bias), bad_words_token_ids=params.bad_words_token_ids,
        )]
    for m in msgs:
        tokens[m.index] += m.token_ids
        lps[m.index] += [x.logprob for x in m.logprobs]
    assert {i: tokens[i] for i in sorted(tokens)} == {i: t for i, (t, _, _) in want.items()}
    for i, (_, wl, _) in want.items():
        assert lps[i] == pytest.approx([x.logprob for x in wl], abs=1e-5)
    got_prompt = msgs[0].prompt_logprobs
    assert got_prompt.num_leading_none == 1
    assert [e.logprob for e in got_prompt.entries] == pytest.approx([e.logprob for e in want_prompt[1:]], abs=1e-5)
    await cluster.wait_idle(timeout_s=2.0)


async def test_failed_kv_pull_recomputes_and_still_equals_colocated(lm, greedy_tokens):
    c = await InprocCluster(lm, corrupt=True, verify_checksum=True).start()  # every KV pull fails its checksum
    try:
        prompt = lm.tokenizer.encode(PROMPT)
        params = every_parameter(greedy_tokens, temperature=0.9, seed=5, n=3)
        want = await colocated(c, prompt, params, "col-fallback")
        got = await routed(c, prompt, params, "dis-fallback")
        assert_same(got, want)
        assert c.backend.counters["kv_recomputed"] == 1
        await c.wait_idle(timeout_s=2.0)
    finally:
        await c.stop()
