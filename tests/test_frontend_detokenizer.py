"""Incremental detokenization: DecodeStream path, offset fallback, UTF-8 safety, specials."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from splitserve.frontend.detokenizer import IncrementalDetokenizer, OffsetDecoder
from splitserve.frontend.testing import SimpleTokenizer

STORY = (
    "Once upon a time, there was a little girl named Lily. She liked to play outside with her dog, Max. "
    "One day, they found a big red ball in the park!"
)


@pytest.fixture(scope="module")
def bytes_tok() -> SimpleTokenizer:
    """Byte-level BPE without merges: every UTF-8 byte is its own token, so characters split."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<eos>"])
    return SimpleTokenizer(hf, eos_token="<eos>")


def run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(t) for t in ids]


def test_encode_prepends_bos(tok: SimpleTokenizer) -> None:
    assert tok.encode("Once upon")[0] == 1
    assert tok.encode("Once upon", add_special_tokens=False)[0] != 1


def test_deltas_equal_decode_of_generated_ids_first_token_included(tok: SimpleTokenizer) -> None:
    # Prompt is only BOS: the generated text must equal a plain decode of the generated ids,
    # including the first token (whose SentencePiece leading space is stripped by decode).
    gen = tok.encode(STORY, add_special_tokens=False)
    deltas = run(IncrementalDetokenizer(tok, [1]), gen)
    assert "".join(deltas) == tok.decode(gen) == STORY
    assert deltas[0] == "" or not deltas[0].startswith(" ")


def test_deltas_after_prompt_keep_leading_space_and_never_repeat_prompt(tok: SimpleTokenizer) -> None:
    full = tok.encode(STORY)
    for cut in (3, 7, 12, 20):
        prompt, gen = full[:cut], full[cut:]
        text = "".join(run(IncrementalDetokenizer(tok, prompt), gen))
        expected = tok.decode(full)[len(tok.decode(prompt)) :]
        assert text == expected, cut
        assert tok.decode(prompt) + text == STORY


def test_first_token_after_prompt_gets_its_space(tok: SimpleTokenizer) -> None:
    prompt = tok.encode("Once upon a time")
    gen = tok.encode(" there was", add_special_tokens=False)
    out = run(IncrementalDetokenizer(tok, prompt), gen)
    assert "".join(out).startswith(" ")
    assert tok.decode(prompt) + "".join(out) == tok.decode(prompt + gen)


def test_special_tokens_are_not_rendered(tok: SimpleTokenizer) -> None:
    gen = tok.encode("Lily ran.", add_special_tokens=False)
    out = run(IncrementalDetokenizer(tok, [1]), [1, *gen, 2])
    assert "".join(out) == "Lily ran."
    assert out[0] == "" and out[-1] == ""


def test_multibyte_characters_are_never_split(bytes_tok: SimpleTokenizer) -> None:
    text = "Hi 日本語 café 😀 done"
    ids = bytes_tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters span tokens
    out = run(IncrementalDetokenizer(bytes_tok, bytes_tok.encode("prompt: ")), ids)
    assert "".join(out) == text == bytes_tok.decode(ids)
    assert all("\ufffd" not in d for d in out)
    assert out[3:6] == ["", "", "日"]  # 3 bytes: held, held, emitted


def test_incomplete_character_at_the_end_is_not_emitted(bytes_tok: SimpleTokenizer) -> None:
    ids = bytes_tok.encode("ok 😀")[:-2]  # cut inside the emoji
    out = run(IncrementalDetokenizer(bytes_tok, []), ids)
    assert "".join(out) == "ok "


def test_offset_decoder_matches(tok: SimpleTokenizer, bytes_tok: SimpleTokenizer) -> None:
    full = tok.encode(STORY, add_special_tokens=False)
    dec = OffsetDecoder(tok.hf, full[:5])
    text = "".join(d or "" for d in (dec.step(t) for t in full[5:]))
    assert text == tok.decode(full)[len(tok.decode(full[:5])) :]
    ids = bytes_tok.encode("naïve 日本")
    dec = OffsetDecoder(bytes_tok.hf, [])
    steps = [dec.step(t) for t in ids]
    assert "".join(s or "" for s in steps) == "naïve 日本"
    assert all(s is None or "\ufffd" not in s for s in steps)


class _FailingStream:
    """Stands in for a DecodeStream that breaks after some steps."""

    def __init__(self, real, fail_at: int) -> None:
        self.real, self.fail_at, self.n = real, fail_at, 0

    def step(self, hf, token_id):
        self.n += 1
        if self.n >= self.fail_at:
            raise RuntimeError("InvalidPrefix")
        return self.real.step(hf, token_id)


@pytest.mark.parametrize("fail_at", [1, 4, 5, 9])
def test_switches_to_fallback_mid_stream_without_loss(bytes_tok: SimpleTokenizer, fail_at: int) -> None:
    text = "ab日本語 ok"
    ids = bytes_tok.encode(text)
    detok = IncrementalDetokenizer(bytes_tok, bytes_tok.encode("x"))
    detok._stream = _FailingStream(detok._stream, fail_at)
    out = run(detok, ids)
    assert detok.using_fallback
    assert "".join(out) == text
    assert all("\ufffd" not in d for d in out)
