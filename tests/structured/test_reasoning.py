"""The reasoning splitter (conveyor.structured.reasoning): whole answers of each format, and
every way of cutting an answer into streamed pieces gives the whole answer's split."""

from __future__ import annotations

import pytest

from conveyor.structured.reasoning import ReasoningParser, reasoning_token_count, split_reasoning

CASES = [
    # (format, text, reasoning, content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "\n\n  Paris.\n", None, "\n\n  Paris.\n"),  # no think block: the answer as it came
    ("qwen3", " \n", None, " \n"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>\nstill thinking", "still thinking", ""),  # cut short: all reasoning
    ("qwen3", "<thinking is a word", None, "<thinking is a word"),
    ("qwen3", "a </think> b", None, "a </think> b"),  # no opening tag: all content
    ("qwen3", "<think>x < y </thin k></think>\n\n<tool_call>{}", "x < y </thin k>", "<tool_call>{}"),
    ("qwen3", "<think></think>answer", "", "answer"),
    ("deepseek_r1", "I reason.\n</think>\n\nThe answer.", "I reason.", "The answer."),
    ("deepseek_r1", "<think>\nI reason.</think>The answer.", "I reason.", "The answer."),
    ("deepseek_r1", "never closed", "never closed", ""),
    ("deepseek_r1", "</think>only content", "", "only content"),
]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_whole_answers(fmt: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, fmt) == (reasoning, content)


def _streamed(fmt: str, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(fmt)
    reasoning = content = ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_every_two_and_three_piece_cut_equals_the_whole(
    fmt: str, text: str, reasoning: str | None, content: str
) -> None:
    expected = (reasoning or "", content)
    for i in range(len(text) + 1):
        assert _streamed(fmt, [text[:i], text[i:]]) == expected, i
        for j in range(i, len(text) + 1):
            assert _streamed(fmt, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(fmt, list(text)) == expected


def test_reasoning_is_released_before_the_block_closes() -> None:
    """A streamed think block shows its text as it comes, holding only what may be the tag."""
    parser = ReasoningParser("qwen3")
    assert parser.feed("<thi").reasoning == ""
    assert parser.feed("nk>\nStep one").reasoning == "Step one"
    assert parser.feed(", step two</th").reasoning == ", step two"
    delta = parser.feed("ink>\n\nDone")
    assert (delta.reasoning, delta.content) == ("", "Done")


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("o1")


def test_reasoning_tokens_are_those_between_the_tags() -> None:
    """The think block's tokens, tags left out (as the reasoning budget counts them): after the
    opening tag the model wrote (or from the start, where the template opened it), up to the close
    (or the end of an answer cut short inside the block)."""
    think, end = 100, 101
    assert reasoning_token_count([think, 5, 6, 7, end, 8, 9], think, end) == 3
    assert reasoning_token_count([3, think, 5, end, end], think, end) == 1  # leading whitespace token; first close
    assert reasoning_token_count([5, 6, end, 8], think, end) == 2  # deepseek_r1: opened by the template
    assert reasoning_token_count([think, 5, 6], think, end) == 2  # never closed
    assert reasoning_token_count([think, end, 8], think, end) == 0
