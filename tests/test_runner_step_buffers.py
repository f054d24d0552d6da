"""ModelRunner step inputs: preallocated buffers, token slices, and greedy decode equal to fresh-tensor forwards."""

from __future__ import annotations

import torch

from splitserve.engine.runner import ModelRunner, StepBuffers, _token_slice
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.model import AttentionMetadata, load_model
from splitserve.model.rope import RotaryEmbedding, apply_rope, apply_rope_

BS = 4


def test_step_buffers_fill_views_and_grow() -> None:
    buf = StepBuffers(capacity=2)
    ids, pos, slots = buf.fill([5, 6], [0, 1], [8, 9])
    assert ids.tolist() == [5, 6] and pos.tolist() == [0, 1] and slots.tolist() == [8, 9]
    assert ids.dtype == torch.long and buf.capacity == 2
    ids, pos, slots = buf.fill([1, 2, 3], [7, 8, 9], [4, 5, 6])  # grows to the next power of two
    assert buf.capacity == 4
    assert ids.tolist() == [1, 2, 3] and pos.tolist() == [7, 8, 9] and slots.tolist() == [4, 5, 6]
    ids, _, _ = buf.fill([42], [3], [11])
    assert ids.tolist() == [42] and buf.capacity == 4


def test_token_slice_matches_token_ids_on_both_sides_of_the_prompt() -> None:
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4), output_token_ids=[7, 8])
    for start in range(5):
        for end in range(start + 1, 6):
            assert _token_slice(seq, start, end) == seq.token_ids[start:end]


def test_signed_sin_rope_is_bit_identical_to_rotate_half() -> None:
    """roll + signed sin == the in-place rotate-half form (``cat(-x2, x1)``, then mul_/addcmul_) bit for bit,
    and matches the out-of-place reference ``apply_rope``."""
    rotary = RotaryEmbedding(8, 10000.0)
    pos = torch.tensor([0, 3, 17, 300])
    x = torch.randn(4, 3, 8)
    cos, sin = rotary(pos, torch.float32)
    want = x.clone()
    rot = torch.cat((-want[..., 4:], want[..., :4]), dim=-1)
    want.mul_(cos[:, None]).addcmul_(rot, sin[:, None])
    c, s = rotary.cos_sin(pos, 301, torch.float32)
    got = x.clone()
    apply_rope_(got, c, s)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, apply_rope(x, cos, sin))


def test_runner_greedy_decode_equals_fresh_tensor_forwards() -> None:
    """Two sequences (prompts 5 and 7 tokens, block_size 4) decode 6 steps through the runner's reused
    buffers; the same steps with freshly built tensors give the same tokens."""
    torch.manual_seed(0)
    lm = load_model("synthetic:llama-25m", dtype="float32")
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    runner = ModelRunner(lm, lm.model.allocate_kv_cache(8, BS), BS)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0), block_table=t)
            for i, (p, t) in enumerate(zip(prompts, tables))]

    def step(group: list[Sequence]) -> None:
        for seq, tok in zip(group, runner.execute(group)):
            seq.num_computed_tokens += seq.num_step_tokens
            seq.output_token_ids.append(tok)

    step(seqs)  # both prompts in one step
    for _ in range(6):
        step(seqs)

    cache = lm.model.allocate_kv_cache(8, BS)
    expected = []
    for prompt, table in zip(prompts, tables):
        tokens = list(prompt)
        for start in range(len(prompt) - 1, len(prompt) + 6):
            new = tokens[:start + 1] if start == len(prompt) - 1 else [tokens[start]]
            first = start + 1 - len(new)
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(first, start + 1)])
            meta = AttentionMetadata(slots, [len(new)], [start + 1], [table], BS)
            with torch.inference_mode():
                logits = lm.model(torch.tensor(new), torch.arange(first, start + 1), cache, meta)
            tokens.append(int(logits[0].argmax()))
        expected.append(tokens[len(prompt):])
    assert [s.output_token_ids for s in seqs] == expected
