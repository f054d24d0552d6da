import pytest
import torch

from splitserve.engine.sampler import SampleRow
from splitserve.engine.sampler import sample as sample_rows
from splitserve.engine.sampling import SamplingParams


def sample(logits, params, output_indices):
    """The token ids for rows with only ``params`` and ``output_index`` set (no history, no matcher)."""
    return [r.token_id for r in sample_rows(logits, [SampleRow(p, i) for p, i in zip(params, output_indices)])]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0]) == [1, 0]


def test_seeded_sampling_depends_only_on_seed_and_output_index():
    logits = torch.randn(1, 500)
    p = SamplingParams(temperature=1.0, seed=1234)
    draws = [sample(logits, [p], [i])[0] for i in range(20)]
    again = [sample(logits, [p], [i])[0] for i in range(20)]
    assert draws == again
    assert len(set(draws)) > 1
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=99)], [i])[0] for i in range(20)]
    assert other != draws


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]])
    top_k = {sample(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert top_k == {0, 1}
    # probabilities ~[0.5, 0.45, 0.02, ...]: top_p 0.9 keeps exactly the first two
    top_p = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.9, seed=s)], [0])[0] for s in range(200)}
    assert top_p == {0, 1}


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"seed": -1}])
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.5, 9.0, 1.0, -3.0]])
    for t in (5.5e-38, 1e-40, 9e-6):
        assert sample(logits, [SamplingParams(temperature=t)], [0]) == [1]


def test_values_beyond_the_wire_format_are_rejected():
    with pytest.raises(ValueError):
        SamplingParams(top_k=2**31)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2**31)
