"""Token continuity (splitserve.frontend.token_continuity) and its text prefix index: the longest remembered text
that prefixes a prompt, bounded memory, and ids that always decode to what a fresh encode decodes to."""

from __future__ import annotations

import pytest

from splitserve.frontend.chat import render_chat
from splitserve.frontend.text_prefix_index import TextPrefixIndex
from splitserve.frontend.token_continuity import TokenContinuity


def test_index_finds_the_longest_stored_prefix_across_chunk_boundaries() -> None:
    index: TextPrefixIndex[int] = TextPrefixIndex(max_bytes=10**6, chunk_chars=4)
    texts = ["ab", "abcd", "abcdefg", "abcdefgh", "abcdefghij", "abcdX"]
    for i, t in enumerate(texts):
        assert index.put(t, i, 1)
    assert index.longest_prefix("abcdefghijkl") == ("abcdefghij", 4)
    assert index.longest_prefix("abcdefghi") == ("abcdefgh", 3)
    assert index.longest_prefix("abcdefg") == ("abcdefg", 2)  # the text itself counts
    assert index.longest_prefix("abcdeZ") == ("abcd", 1)
    assert index.longest_prefix("abcdXYZ") == ("abcdX", 5)
    assert index.longest_prefix("abc") == ("ab", 0)
    assert index.longest_prefix("a") is None and index.longest_prefix("zzzzzzzz") is None
    assert index.longest_prefix("") is None


def test_index_evicts_least_recently_used_within_its_byte_bound() -> None:
    index: TextPrefixIndex[str] = TextPrefixIndex(max_bytes=30, chunk_chars=4)
    for t in ("one text", "two text", "three text"):
        assert index.put(t, t, 10)
    assert index.longest_prefix("one text and more") == ("one text", "one text")  # now the most recently used
    assert index.put("four text", "four", 10)  # 40 > 30: "two text" (least recently used) goes
    assert index.longest_prefix("two text...") is None
    assert index.longest_prefix("one text!")[1] == "one text" and index.longest_prefix("three text!") is not None
    assert len(index) == 3 and index.nbytes == 30 and index.evictions == 1
    assert not index.put("huge", "x", 31) and len(index) == 3  # larger than the whole bound: not stored
    assert index.put("one text", "replaced", 5) and index.nbytes == 25 and index.longest_prefix("one text")[1] == "replaced"


def test_index_bounds_a_bucket() -> None:
    index: TextPrefixIndex[int] = TextPrefixIndex(max_bytes=10**6, chunk_chars=8, bucket_limit=2)
    for i in range(3):  # one bucket: the same whole chunks, different short tails
        index.put(f"12345678{i}", i, 1)
    assert index.longest_prefix("123456780...") is None  # the oldest was dropped
    assert index.longest_prefix("123456782...") == ("123456782", 2) and len(index) == 2


@pytest.fixture
def continuity(tok) -> TokenContinuity:
    return TokenContinuity(tok)


def test_a_chat_turn_reuses_the_ids_the_model_generated(tok, continuity: TokenContinuity) -> None:
    """The regression: ':' ending the generation prompt merges with the answer's first space on a fresh encode."""
    turn1 = [{"role": "user", "content": "Tell me a story."}]
    prompt1 = render_chat(turn1, None)
    prompt_ids = continuity.encode(prompt1, True)
    assert prompt_ids == tok.encode(prompt1) and continuity.misses == 1
    output = tok.encode(" Once upon a time there was a dog", add_special_tokens=False)[1:]  # as generated after ':'
    answer = tok.decode([*prompt_ids, *output])[len(tok.decode(prompt_ids)):]
    assert answer.startswith(" Once")
    assert continuity.remember(prompt1, True, prompt_ids, [*output, tok.eos_token_ids[0]], answer)  # EOS dropped
    prompt2 = render_chat([*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "More!"}], None)
    fresh = tok.encode(prompt2)
    ids = continuity.encode(prompt2, True)
    assert ids[:len(prompt_ids) + len(output)] == [*prompt_ids, *output]  # the model's own tokens, no re-tokenisation
    assert fresh[:len(prompt_ids) + 1] != ids[:len(prompt_ids) + 1]  # a fresh encode merges ':' + ' ' (the bug)
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(fresh, skip_special_tokens=False)
    assert continuity.hits == 1 and continuity.mismatches == 0


def test_text_completion_continuation_and_a_stop_string_trimmed(tok, continuity: TokenContinuity) -> None:
    prompt = "Once upon a time, there was a little girl named Lily."
    prompt_ids = tok.encode(prompt)
    output = tok.encode(" She liked to play outside. The end", add_special_tokens=False)[1:]
    full = tok.decode([*prompt_ids, *output])[len(tok.decode(prompt_ids)):]
    shown = full.removesuffix(" The end")  # a stop string " The" cut the text; its tokens were generated
    assert continuity.remember(prompt, True, prompt_ids, output, shown)
    later = prompt + shown + " One day"
    ids = continuity.encode(later, True)
    assert continuity.hits == 1 and ids[:len(prompt_ids)] == prompt_ids
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(tok.encode(later), skip_special_tokens=False)
    # ignore_eos: an EOS generated mid-answer is not in the text; the head before it is remembered
    eos = tok.eos_token_ids[0]
    tail = tok.encode(" Then she went home", add_special_tokens=False)[1:]
    text_before = tok.decode([*prompt_ids, *output])[len(tok.decode(prompt_ids)):]
    shown2 = tok.decode([*prompt_ids, *output, eos, *tail])[len(tok.decode(prompt_ids)):]
    assert continuity.remember("P2: " + prompt, True, prompt_ids, [*output, eos, *tail], shown2)
    found = continuity.index.longest_prefix("P2: " + prompt + shown2)
    assert found[0] == "P2: " + prompt + text_before and list(found[1][1]) == [*prompt_ids, *output]
    # a completion text that is not what the tokens say is never stored
    assert not continuity.remember("other prompt", True, tok.encode("other prompt"), output, "something else")


def test_a_continuation_that_does_not_verify_falls_back_to_a_fresh_encode(tok, continuity: TokenContinuity,
                                                                          monkeypatch) -> None:
    prompt = "The cat sat on the mat and looked at the sun."
    prompt_ids = tok.encode(prompt)
    output = tok.encode(" It was warm", add_special_tokens=False)[1:]
    shown = tok.decode([*prompt_ids, *output])[len(tok.decode(prompt_ids)):]
    assert continuity.remember(prompt, True, prompt_ids, output, shown)
    later = prompt + shown + " and happy."
    monkeypatch.setattr(continuity, "continuation", lambda rest: tok.encode(rest + "!", add_special_tokens=False))
    assert continuity.encode(later, True) == tok.encode(later)
    assert continuity.mismatches == 1 and continuity.hits == 0
    monkeypatch.setattr(continuity, "continuation", lambda rest: None)  # the anchor did not encode cleanly
    assert continuity.encode(later, True) == tok.encode(later) and continuity.mismatches == 2
    assert continuity.encode(later, False) == tok.encode(later, add_special_tokens=False)  # other BOS rule: a miss
    assert continuity.misses == 1
