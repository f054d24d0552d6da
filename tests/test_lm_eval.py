"""lm-evaluation-harness against the disaggregated cluster: a loglikelihood (multiple-choice) task whose data ships
with the repository (tests/data/lm_eval), model ``local-completions`` pointed at the router, fully offline.

Every per-item loglikelihood lm-eval logs must equal transformers' (fp32) within 1e-4 nats. Why 1e-4: both sides
run the same fp32 weights on the same token ids; they differ only in kernel order (paged attention, fused matmuls vs
Hugging Face's eager path), about 1e-6 per logprob here, and a continuation sums a handful of them (< 12 tokens).
The greedy flags and the accuracy lm-eval reports must equal the reference's too.
"""

import json

import pytest

from splitserve.paths import default_model_path
from tests.lm_eval_run import TASK, TASK_DIR, Reference, run_lm_eval

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "TinyStories-656K"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    return Reference(default_model_path())


def test_shipped_task_splits_cleanly(reference):
    """The task's data is chosen so that lm-eval's tokenization keeps each context intact and scores at least
    one continuation token (this tokenizer puts spaces at the end of tokens, so most ``word`` + ``" word"``
    splits would score a piece of the context)."""
    docs = [json.loads(line) for line in (TASK_DIR / "tinystories_mc.jsonl").read_text().splitlines()]
    assert 10 <= len(docs) <= 20
    for doc in docs:
        for choice in doc["choices"]:
            assert reference.splits_cleanly(doc["context"], choice), (doc["context"], choice)


def test_lm_eval_loglikelihoods_equal_transformers(cluster, reference, tmp_path):
    base_url, _, _ = cluster
    printed, samples, results = run_lm_eval(base_url, MODEL, default_model_path(), tmp_path)
    print(printed[-2000:])  # the results table lm-eval printed (pytest -s shows it)
    assert len(samples) == 33  # 11 documents x 3 choices
    correct = 0
    by_doc: dict[int, list[float]] = {}
    for s in samples:
        expected, greedy = reference.loglikelihood(s.context, s.continuation)
        assert s.loglikelihood == pytest.approx(expected, abs=TOLERANCE), (s, expected)
        assert s.loglikelihood < 0
        assert s.is_greedy == greedy, (s, greedy)
        by_doc.setdefault(s.doc_id, []).append(expected)
    for lls in by_doc.values():
        correct += max(range(len(lls)), key=lls.__getitem__) == 0  # every label is 0 (the first choice)
    acc = results["results"][TASK]["acc,none"]
    assert acc == pytest.approx(correct / len(by_doc))
    assert f"{TASK}" in printed and "acc" in printed
