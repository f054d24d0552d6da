"""Stop strings: held-back partial matches, cuts across deltas, earliest match wins."""

from __future__ import annotations

import pytest

from splitserve.frontend.stop import StopChecker


def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], StopChecker]:
    checker = StopChecker(stops)
    out = []
    for p in pieces:
        out.append(checker.feed(p))
        if checker.stopped:
            break
    if not checker.stopped:
        out.append(checker.flush())
    return out, checker


def test_no_stops_passes_everything_through() -> None:
    out, checker = feed_all([], ["a", "b", "c"])
    assert out == ["a", "b", "c", ""] and not checker.stopped


def test_stop_spanning_pieces_is_cut_and_never_partially_emitted() -> None:
    out, checker = feed_all(["STOP"], ["hello S", "T", "O", "P tail"])
    assert out == ["hello ", "", "", ""]
    assert checker.stopped and checker.matched == "STOP"


def test_partial_match_released_when_it_does_not_complete() -> None:
    out, checker = feed_all(["STOP"], ["hello S", "T", "x", " end"])
    assert out == ["hello ", "", "STx", " end", ""]
    assert not checker.stopped


def test_held_tail_released_at_flush() -> None:
    out, checker = feed_all(["STOP"], ["abc ST"])
    assert out == ["abc ", "ST"]


def test_earliest_of_several_stops_wins() -> None:
    out, checker = feed_all(["world", "lo w"], ["hel", "lo world"])
    assert "".join(out) == "hel" and checker.matched == "lo w"


def test_stop_inside_a_single_piece() -> None:
    out, checker = feed_all(["\n\n"], ["one\n\ntwo"])
    assert out == ["one"] and checker.stopped


def test_overlapping_prefixes() -> None:
    # "aab" where the text is "aaab": the held tail must shift correctly.
    out, checker = feed_all(["aab"], ["a", "a", "a", "b"])
    assert "".join(out) == "a" and checker.stopped


def test_input_after_stop_is_ignored() -> None:
    checker = StopChecker(["x"])
    assert checker.feed("ax") == "a"
    assert checker.feed("more") == "" and checker.flush() == ""


@pytest.mark.parametrize("text", ["The cat sat. The end. Then more", "no stop here at all"])
def test_char_by_char_equals_one_shot(text: str) -> None:
    stops = ["The end", "zzz"]
    out, _ = feed_all(stops, list(text))
    one, _ = feed_all(stops, [text])
    assert "".join(out) == "".join(one)
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    assert "".join(out) == text[:cut]
