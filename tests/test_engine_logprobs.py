"""Logprobs in the engine: output-token logprobs (first token included) and prompt logprobs equal transformers'
fp32 log_softmax (1e-4), with and without chunked prefill; per-sequence grammar matchers (a fake one here)."""

import asyncio

import pytest
import torch

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.paths import default_model_path

transformers = pytest.importorskip("transformers")

TEXT = "Once upon a time there was a little girl named Lily who loved to play in the park with her dog"
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    return transformers.LlamaForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """float32 ``[len(ids), vocab]``: row j is log_softmax of the logits predicting token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check(entry, ref_row: torch.Tensor, token_id: int, k: int) -> None:
    assert entry.token_id == token_id
    assert abs(entry.logprob - ref_row[token_id].item()) < ATOL
    value = ref_row[token_id].item()  # 1-based rank, up to ties within the tolerance
    assert int((ref_row > value + ATOL).sum()) + 1 <= entry.rank <= int((ref_row > value - ATOL).sum())
    top_vals, top_ids = torch.topk(ref_row, k)
    assert len(entry.top) == k
    for (tid, lp), rid, rv in zip(entry.top, top_ids.tolist(), top_vals.tolist()):
        assert abs(lp - rv) < ATOL and (tid == rid or abs(ref_row[tid].item() - rv) < ATOL)


async def started(lm, **cfg) -> AsyncEngine:
    eng = AsyncEngine(lm, EngineConfig(block_size=4, num_blocks=256, **cfg))
    await eng.start()
    return eng


async def all_free(engine) -> bool:
    return await asyncio.wrap_future(engine.core.call(lambda: engine.block_manager.num_free)) == engine.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
async def test_prompt_logprobs_equal_transformers(lm, hf, chunked):
    """Chunked: 5-token steps, so the prompt is computed over several chunks (and shares steps with a decode)."""
    engine = await started(lm, enable_chunked_prefill=chunked, max_num_batched_tokens=5 if chunked else 4096)
    try:
        prompt = lm.tokenizer.encode(TEXT)
        ref = reference_logprobs(hf, prompt)
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
        other = engine.generate("busy", prompt[:6], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        busy = asyncio.ensure_future(anext(other))
        pre = await engine.prefill("p", prompt, params)
        pre.blocks.free()
        await busy
        await other.aclose()
        outs = [o async for o in engine.generate("g", prompt, params)]
        for plp in (pre.prompt_logprobs, outs[0].prompt_logprobs):
            assert len(plp) == len(prompt) and plp[0] is None
            for j in range(1, len(prompt)):
                check(plp[j], ref[j - 1], prompt[j], 2)
        assert all(o.prompt_logprobs is None for o in outs[1:])
        assert await all_free(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("n", [1, 3])
async def test_output_logprobs_equal_transformers(lm, hf, n):
    """Each token's logprob (the prefill-sampled first token included) is log_softmax of the logits that the
    reference forward over prompt + output gives at its position (temperature does not change it)."""
    engine = await started(lm)
    try:
        prompt = lm.tokenizer.encode(TEXT)[:11]
        params = SamplingParams(max_tokens=8, temperature=0.7, seed=11, ignore_eos=True, logprobs=3, n=n)
        per_choice: dict[int, list] = {}
        async for out in engine.generate("g", prompt, params):
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            per_choice.setdefault(out.index, []).extend(out.logprobs)
        assert sorted(per_choice) == list(range(n))
        for entries in per_choice.values():
            ids = prompt + [e.token_id for e in entries]
            ref = reference_logprobs(hf, ids)
            for j, entry in enumerate(entries):
                check(entry, ref[len(prompt) - 1 + j], entry.token_id, 3)
        pre = await engine.prefill("p", prompt, params)
        pre.blocks.free()
        assert [lp.token_id for lp in pre.first_logprobs] == pre.first_token_ids
        assert [lp.token_id for lp in pre.first_logprobs] == [per_choice[i][0].token_id for i in range(n)]
        assert await all_free(engine)
    finally:
        await engine.stop()


async def test_prompt_logprobs_refuse_cached_prefix_blocks(lm):
    engine = await started(lm)
    try:
        prompt = lm.tokenizer.encode(TEXT)[:12]
        async with await engine.allocate_blocks(2) as cached:
            with pytest.raises(InvalidRequest, match="prompt_logprobs"):
                await engine.prefill("p", prompt, SamplingParams(prompt_logprobs=0), cached=cached, num_cached_tokens=8)
        assert await all_free(engine)
    finally:
        await engine.stop()


class EvenTokens:
    """A GuidedMatcher: only even token ids (EOS 2 included) may follow; records what it accepted."""

    instances: list = []

    def __init__(self, refuse_after: int | None = None) -> None:
        self.accepted: list[int] = []
        self.refuse_after = refuse_after
        EvenTokens.instances.append(self)

    def fill_mask(self, mask: torch.Tensor) -> None:
        mask[1::2] = False

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id % 2 == 0 and (self.refuse_after is None or len(self.accepted) <= self.refuse_after)

    def is_terminated(self) -> bool:
        return False


@pytest.fixture
def fake_guided(monkeypatch):
    import splitserve.engine.guided as guided

    EvenTokens.instances = []
    made = {"refuse_after": None}
    monkeypatch.setattr(guided, "make_matcher", lambda spec, tokenizer, vocab, eos_token_ids=None: EvenTokens(made["refuse_after"]), raising=False)
    return made


async def test_each_choice_has_its_own_matcher_advanced_over_its_tokens(lm, fake_guided):
    from splitserve.engine.guided_spec import GuidedSpec

    engine = await started(lm)
    try:
        prompt = lm.tokenizer.encode(TEXT)[:9]
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=2, n=3, guided=GuidedSpec("regex", "x*"))
        per_choice: dict[int, list[int]] = {}
        async for out in engine.generate("g", prompt, params):
            per_choice.setdefault(out.index, []).extend(out.token_ids)
        tokens = [t for toks in per_choice.values() for t in toks]
        assert tokens and all(t % 2 == 0 for t in tokens)
        # instance 0 masked the prefill (accepts nothing); one per choice then accepted exactly that choice's tokens
        accepted = sorted(tuple(m.accepted) for m in EvenTokens.instances[1:])
        assert EvenTokens.instances[0].accepted == [] and accepted == sorted(tuple(t) for t in per_choice.values())
        assert await all_free(engine)
    finally:
        await engine.stop()


async def test_a_token_the_matcher_refuses_fails_the_request_and_frees_its_blocks(lm, fake_guided):
    from splitserve.engine.guided_spec import GuidedSpec

    fake_guided["refuse_after"] = 3
    engine = await started(lm)
    try:
        prompt = lm.tokenizer.encode(TEXT)[:9]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2, guided=GuidedSpec("regex", "x*"))
        with pytest.raises(RuntimeError, match="grammar"):
            async for _ in engine.generate("g", prompt, params):
                pass
        assert await all_free(engine)  # the engine freed them before it reported the error
        stats = await engine.stats()
        assert stats["requests_running"] == 0
    finally:
        await engine.stop()
