"""Sampling parameters and logprobs against small plain-numpy reference implementations on fixed logits."""

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from splitserve.engine import logprob_calc
from splitserve.engine.logprob_calc import token_logprobs
from splitserve.engine.sampler import SampleRow, process_row, prompt_logprobs, sample
from splitserve.engine.sampling import SamplingParams

V = 12
EOS = (11,)
LOGITS = torch.tensor([
    [1.5, -0.5, 3.0, 0.2, -2.0, 2.5, 0.0, -1.0, 1.0, 0.7, -0.3, 2.9],
    [-1.0, 2.0, 0.5, 1.8, -0.2, 0.3, 2.2, -3.0, 0.9, 1.1, 0.0, 1.7],
], dtype=torch.float32)


def ref_process(logits, p, prompt=(), output=(), output_index=None, eos=EOS, grammar_allowed=None):
    """Plain-numpy reference of the processors, in the documented order."""
    x = np.array(logits, dtype=np.float64)
    output_index = len(output) if output_index is None else output_index
    for t, b in p.logit_bias:
        x[t] += b
    if p.allowed_token_ids is not None:
        x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = -np.inf
    for word in p.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or list(output[len(output) - len(prefix):]) == prefix):
            x[word[-1]] = -np.inf
    if grammar_allowed is not None:
        x[[t for t in range(len(x)) if t not in grammar_allowed]] = -np.inf
    if output_index < p.min_tokens:
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))] = -np.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    return x


def ref_log_softmax(x):
    m = np.max(x[np.isfinite(x)])
    return x - m - np.log(np.sum(np.exp(x - m)))


def row(p, output=(), prompt=(), output_index=None, matcher=None):
    return SampleRow(p, len(output) if output_index is None else output_index, prompt, output, matcher, EOS)


def check_processed(p, output=(), prompt=(), r=0, **kw):
    got = process_row(LOGITS[r], row(p, output, prompt, **kw)).numpy()
    want = ref_process(LOGITS[r].numpy(), p, prompt, output, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    return want


def test_logit_bias_adds_to_the_logits_and_moves_greedy():
    p = SamplingParams(temperature=0, logit_bias=((4, 10.0), (2, -100.0), (0, 0.5)))
    want = check_processed(p)
    assert sample(LOGITS[:1], [row(p)])[0].token_id == int(np.argmax(want)) == 4


def test_allowed_token_ids_restrict_greedy_and_sampling():
    p = SamplingParams(temperature=0, allowed_token_ids=(0, 6, 9))
    check_processed(p)
    assert sample(LOGITS[:1], [row(p)])[0].token_id == 0
    hot = SamplingParams(temperature=50.0, allowed_token_ids=(0, 6, 9))
    drawn = {sample(LOGITS[:1], [row(dataclasses.replace(hot, seed=s))])[0].token_id for s in range(100)}
    assert drawn == {0, 6, 9}


@pytest.mark.parametrize("output, banned", [
    ((), {5}),  # only the one-token word; (3, 2) needs one output token, (7, 3, 2) two
    ((3,), {5, 2}),  # output ends with 3: the 2 of (3, 2) is banned
    ((7, 3), {5, 2, 9}),  # ends with (7, 3): (3, 2) and (7, 3, 9)
    ((8, 3), {5, 2}),  # ends with 3 but not (7, 3)
    ((3, 1), {5}),
])
def test_bad_words_ban_the_last_token_after_the_rest(output, banned):
    p = SamplingParams(bad_words_token_ids=((5,), (3, 2), (7, 3, 9)))
    got = process_row(LOGITS[0], row(p, output))
    assert {t for t in range(V) if got[t] == float("-inf")} == banned
    check_processed(p, output)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(2,))
    for n in range(3):
        got = process_row(LOGITS[0], row(p, (0,) * n))
        assert got[11] == got[2] == float("-inf")
        check_processed(p, (0,) * n)
        assert sample(LOGITS[:1], [row(p, (0,) * n)])[0].token_id == 5  # 2 (3.0) and EOS 11 (2.9) banned
    assert not row(p, (0,) * 3).needs_processing
    assert sample(LOGITS[:1], [row(p, (0,) * 3)])[0].token_id == 2
    keep_eos = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    assert sample(LOGITS[:1], [row(keep_eos)])[0].token_id == 11
    check_processed(keep_eos)


def test_min_tokens_yields_to_a_constraint_that_only_admits_eos():
    p = SamplingParams(temperature=0, min_tokens=5, allowed_token_ids=(11,))
    assert sample(LOGITS[:1], [row(p)])[0].token_id == 11


def test_constraints_that_leave_nothing_fail_their_row_only():
    p = SamplingParams(allowed_token_ids=(3,), bad_words_token_ids=((3,),))
    with pytest.raises(ValueError, match="no possible token"):
        process_row(LOGITS[0], row(p))
    bad, good = sample(LOGITS[:2], [row(p), row(SamplingParams(temperature=0))])
    assert "no possible token" in bad.error and bad.logprob is None
    assert good.error is None and good.token_id == int(LOGITS[1].argmax())


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"presence_penalty": -0.7, "frequency_penalty": 1.9, "repetition_penalty": 1.3},
])
def test_penalties_match_the_reference(kw):
    p = SamplingParams(temperature=0, **kw)
    prompt, output = (0, 1, 4, 4), (2, 2, 2, 5, 10, 1)
    for r in range(2):
        want = check_processed(p, output, prompt, r=r)
        assert sample(LOGITS[r:r + 1], [row(p, output, prompt)])[0].token_id == int(np.argmax(want))


def test_presence_and_frequency_ignore_the_prompt_repetition_does_not():
    prompt = (2,)
    assert process_row(LOGITS[0], row(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), (), prompt))[2] == 3.0
    assert process_row(LOGITS[0], row(SamplingParams(repetition_penalty=2.0), (), prompt))[2] == 1.5


class AllowOnly:
    """A GuidedMatcher stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def fill_mask(self, mask):
        assert mask.dtype == torch.bool and mask.all()
        for t in range(mask.numel()):
            mask[t] = t in self.allowed

    def accept(self, token_id):
        self.accepted.append(token_id)
        return True

    def is_terminated(self):
        return False


def test_every_processor_together_matches_the_reference_and_greedy_is_its_argmax():
    p = SamplingParams(temperature=0, logit_bias=((3, 1.0), (6, -0.5)), allowed_token_ids=tuple(range(1, 12)),
                       bad_words_token_ids=((9,), (1, 8)), min_tokens=4, stop_token_ids=(6,),
                       repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2, logprobs=3)
    prompt, output, grammar = (3, 5), (7, 1), {1, 2, 3, 5, 8, 9, 11}
    for r in range(2):
        matcher = AllowOnly(grammar)
        res = sample(LOGITS[r:r + 1], [row(p, output, prompt, matcher=matcher)])[0]
        want = ref_process(LOGITS[r].numpy(), p, prompt, output, grammar_allowed=grammar)
        got = process_row(LOGITS[r], row(p, output, prompt, matcher=AllowOnly(grammar))).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert res.token_id == int(np.argmax(want))
        assert res.logprob.logprob == pytest.approx(ref_log_softmax(want)[res.token_id], abs=1e-5)
        assert matcher.accepted == []  # the engine advances the matcher, not the sampler


def test_logprobs_without_processors_equal_log_softmax_and_ignore_temperature():
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 4
    rows = [row(SamplingParams(temperature=t, seed=7, logprobs=5)) for t in (0.0, 0.5, 2.0)]
    results = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for r, res in enumerate(results):
        lp = res.logprob
        assert lp.token_id == res.token_id
        assert lp.logprob == pytest.approx(raw[r, res.token_id].item(), abs=1e-6)
        order = np.argsort(-raw[r].numpy(), kind="stable")
        assert [t for t, _ in lp.top] == order[:5].tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[r, order[:5]].tolist(), abs=1e-6)
        assert lp.rank == int((raw[r] > raw[r, res.token_id]).sum()) + 1
    assert results[0].logprob.rank == 1


def test_logprobs_are_taken_after_processors_and_only_when_asked():
    p = SamplingParams(temperature=0, logit_bias=((4, 5.0),), logprobs=0)
    res = sample(LOGITS, [row(p), row(SamplingParams(temperature=0))])
    want = ref_log_softmax(ref_process(LOGITS[0].numpy(), p))
    assert res[0].logprob.logprob == pytest.approx(want[4], abs=1e-5) and res[0].logprob.top == ()
    assert res[1].logprob is None


def test_rank_of_an_unlikely_token():
    lp = torch.log_softmax(LOGITS, dim=-1)
    tl = token_logprobs(lp, [4, 7], [2, 0])
    assert [t.rank for t in tl] == [12, 12]  # the least likely token of each row
    assert [t for t, _ in tl[0].top] == [2, 11] and tl[1].top == ()


def test_min_p_keeps_tokens_above_min_p_times_the_top_probability():
    probs = np.exp(ref_log_softmax(LOGITS[0].numpy().astype(np.float64)))
    keep = {t for t in range(V) if probs[t] >= 0.3 * probs.max()}
    drawn = {sample(LOGITS[:1], [row(SamplingParams(min_p=0.3, seed=s))])[0].token_id for s in range(300)}
    assert drawn == keep and len(keep) > 1


def test_seeded_draws_with_processors_are_reproducible_and_batch_independent():
    p = SamplingParams(temperature=1.2, seed=42, repetition_penalty=1.3, logit_bias=((7, 2.0),), top_p=0.95,
                       min_p=0.01, top_k=8, logprobs=2)
    alone = [sample(LOGITS[1:], [row(p, (1, 6) * i)])[0] for i in range(10)]
    batched = [sample(LOGITS, [row(SamplingParams(temperature=0)), row(p, (1, 6) * i)])[1] for i in range(10)]
    assert alone == batched
    assert len({r.token_id for r in alone}) > 1


def test_logits_are_not_modified():
    before = LOGITS.clone()
    sample(LOGITS, [row(SamplingParams(repetition_penalty=2.0, logit_bias=((1, 3.0),), logprobs=1), (1,)),
                    row(SamplingParams(allowed_token_ids=(0,)))])
    assert torch.equal(LOGITS, before)


def test_row_count_must_match():
    with pytest.raises(ValueError):
        sample(LOGITS, [row(SamplingParams())])


def test_prompt_logprobs_are_the_raw_log_softmax_of_the_previous_position():
    torch.manual_seed(5)
    prompt = [3, 17, 0, 29, 29, 8]
    logits = torch.randn(len(prompt), 30) * 3  # every position; the last row predicts nothing in the prompt
    got = prompt_logprobs(logits, prompt, 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert got[0] is None and len(got) == len(prompt)
    for j in range(1, len(prompt)):
        e = got[j]
        assert e.token_id == prompt[j]
        assert e.logprob == pytest.approx(raw[j - 1, prompt[j]].item(), abs=1e-6)
        assert e.rank == int((raw[j - 1] > raw[j - 1, prompt[j]]).sum()) + 1
        assert [t for t, _ in e.top] == torch.topk(raw[j - 1], 4).indices.tolist()
    # a chunked prefill computes the same entries chunk by chunk
    chunked = prompt_logprobs(logits[:3], prompt[:4], 4) + prompt_logprobs(logits[3:5], prompt[3:6], 4)[1:]
    assert chunked == got
    assert prompt_logprobs(logits[:1], prompt[:1], 4) == [None]
    with pytest.raises(ValueError):
        prompt_logprobs(logits[:2], prompt, 0)


def test_prompt_logprobs_row_chunks_do_not_change_the_result(monkeypatch):
    torch.manual_seed(6)
    prompt = torch.randint(0, 40, (9,)).tolist()
    logits = torch.randn(8, 40)
    whole = prompt_logprobs(logits, prompt, 3)
    monkeypatch.setattr(logprob_calc, "_PROMPT_ROWS_PER_CHUNK", 3)
    assert prompt_logprobs(logits, prompt, 3) == whole
