"""StopStringMatcher: a stream never shows any part of a stop string, wherever deltas split it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.frontend.stop import StopStringMatcher


def run(stop: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed ``deltas``; return what each feed (and the final flush, unless stopped) released."""
    matcher = StopStringMatcher(stop)
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, matcher.stopped


def test_stop_string_split_across_deltas_is_never_shown() -> None:
    out, stopped = run(["STOP"], ["abc ST", "O", "P and more"])
    assert out == ["abc ", "", ""] and stopped


def test_text_that_only_looked_like_a_stop_string_is_released() -> None:
    out, stopped = run(["STOP"], ["abc ST", "O", "RM"])
    assert out == ["abc ", "", "STORM", ""] and not stopped


def test_stop_at_the_very_start() -> None:
    matcher = StopStringMatcher(["Hello"])
    assert matcher.feed("Hello world") == ("", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_held_back_text_is_released_at_flush() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the story EN") == ("the story ", False)
    assert matcher.flush() == "EN"
    assert not matcher.stopped


def test_earliest_match_wins_across_overlapping_stop_strings() -> None:
    # "bc" matches first in time, but "abcd" starts earlier once it completes
    assert run(["abcd", "bc"], ["ab", "c", "d"]) == (["", "", ""], True)
    # ... and if it does not complete, "bc" stands
    assert run(["abcd", "bc"], ["ab", "c", "x"]) == (["", "", "a"], True)
    # a match waiting on an earlier candidate is resolved by flush
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.flush() == "a" and matcher.stopped


def test_self_overlapping_stop_string() -> None:
    assert "".join(run(["aab"], ["a", "a", "a", "b"])[0]) == "a"
    assert "".join(run(["aab"], ["aaa", "c"])[0]) == "aaac"


def test_no_stop_strings_is_pass_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""
    assert run(["", ""], ["abc"]) == (["abc", ""], False)  # empty strings are ignored


def test_multibyte_stop_strings() -> None:
    assert run(["。"], ["你好", "世界。", "再见"]) == (["你好", "世界"], True)


def reference(stop: list[str], text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@settings(max_examples=300, deadline=None)
@given(
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    text=st.text(alphabet="abcd", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stream_equals_the_text_cut_at_the_earliest_stop(stop, text, cuts) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run(stop, deltas)
    expected, expect_stop = reference(stop, text)
    assert "".join(out) == expected
    assert stopped == expect_stop  # text once released is never taken back, so no part of a match showed


def released_after(stop: list[str], text: str) -> tuple[str, bool]:
    """What a stream may show of ``text`` so far, by definition: the text cut at the earliest
    match if no stop string can still match earlier, else the text up to the longest tail
    that could still grow into a stop string (a proper prefix of one)."""
    stop = [s for s in stop if s]
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    n = len(text)
    tail = next((i for i in range(n) if any(len(s) > n - i and s.startswith(text[i:]) for s in stop)), n)
    if hits and min(hits) <= tail:
        return text[: min(hits)], True
    return text[:tail], False


@settings(max_examples=500, deadline=None)
@given(
    stop=st.lists(st.text(alphabet="ab\n😀", min_size=1, max_size=5), max_size=4),
    deltas=st.lists(st.text(alphabet="ab\nc😀 ", max_size=6), max_size=10),
)
def test_every_feed_releases_exactly_what_may_be_shown(stop, deltas) -> None:
    """Feed by feed (not just in total): no held-back text is shown early, none is held for nothing.
    Covers the quick path (a delta without any stop string's first character)."""
    matcher = StopStringMatcher(stop)
    shown, text = "", ""
    for delta in deltas:
        text += delta
        out, stopped = matcher.feed(delta)
        shown += out
        assert (shown, stopped) == released_after(stop, text)
        if stopped:
            return
    shown += matcher.flush()
    assert shown == reference(stop, text)[0]


def test_min_tokens_passes_its_first_feeds_through_unsearched() -> None:
    """The first ``min_tokens`` feeds (one per output token) are neither matched nor held;
    a stop string is looked for from the next one on, in the text fed from then."""
    matcher = StopStringMatcher(["ab"], min_tokens=2)
    assert matcher.feed("ab") == ("ab", False)  # token 1: no match yet
    assert matcher.feed("a") == ("a", False)  # token 2: not held back either
    assert matcher.feed("b") == ("b", False)  # token 3: "a" + "b" spans the boundary: not a match
    assert matcher.feed("xab") == ("x", True)
    assert StopStringMatcher(["ab"]).feed("ab") == ("", True)  # without min_tokens, at once
