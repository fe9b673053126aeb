"""IncrementalDetokenizer: streamed deltas add up to the full decode, never show a stray U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conveyor.frontend.detokenizer import MAX_PROMPT_TAIL_TOKENS, IncrementalDetokenizer

NAMES = ["bytelevel", "chatml", "spm", "spm_legacy", "demo"]
BYTE_LEVEL = {"bytelevel", "chatml", "demo"}
TEXT = "Café déjà vu — naïve Straße! 😀 你好世界 👨‍👩‍👧 🇫🇷 日本語 done."
PROMPTS = ["", "Question:", "Translate: 你好", "<s>[INST] hi [/INST]", "<|im_start|>assistant\n"]


def complete_prefix(tok, prompt: list[int], skip: bool = True) -> list[int]:
    """The prompt without an incomplete character at its end: the output owns that one."""
    for end in range(len(prompt), max(0, len(prompt) - MAX_PROMPT_TAIL_TOKENS) - 1, -1):
        if not tok.decode(prompt[:end], skip_special_tokens=skip).endswith("\ufffd"):
            return prompt[:end]
    return prompt


def reference(tok, prompt: list[int], output: list[int], skip: bool = True) -> str | None:
    """What the stream must add up to: the full text minus the text of the prompt's complete characters.

    None where no stream can match: a byte-fallback run that the output extends into
    invalid UTF-8 turns the prompt's own text into U+FFFDs.
    """
    before = tok.decode(complete_prefix(tok, prompt, skip), skip_special_tokens=skip)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    return full[len(before) :] if full.startswith(before) else None


def stream(tok, prompt, chunks, skip=True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    return deltas, detok


def in_byte_run(tok, ids: list[int], skip: bool) -> bool:
    visible = [i for i in ids if 0 <= i < tok.vocab_size and not (skip and i in tok.skipped_ids)]
    return bool(visible) and visible[-1] in tok.byte_pieces


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_stream_to_the_full_decode(name, ours, data) -> None:
    tok = ours[name]
    ids = st.integers(0, tok.vocab_size + 3)  # a few ids past the vocabulary, as padded models emit
    prompt = data.draw(st.one_of(st.sampled_from(PROMPTS).map(tok.encode), st.lists(ids, max_size=8)), label="prompt")
    output = data.draw(st.lists(ids, max_size=30), label="output")
    skip = data.draw(st.booleans(), label="skip")
    final = reference(tok, prompt, output, skip)
    assume(final is not None)
    if name not in BYTE_LEVEL:
        # A byte-fallback prompt whose last complete character lies more than one character's
        # bytes (3 pieces) back holds invalid bytes of its own: the reference would count their
        # U+FFFDs as output, while the stream rightly shows only what the output adds.
        assume(len(prompt) - len(complete_prefix(tok, prompt, skip)) <= 3)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    for k, token in enumerate(output, 1):
        detok.push([token])
        assert final.startswith(detok.text)
        # nothing is held back without a reason: an incomplete character or a byte run
        so_far = reference(tok, prompt, output[:k], skip)
        if so_far is not None and not so_far.endswith("\ufffd") and not in_byte_run(tok, prompt + output[:k], skip):
            assert detok.text == so_far
    detok.flush()
    assert detok.text == final
    if name in BYTE_LEVEL and complete_prefix(tok, prompt, skip) == prompt:
        assert detok.text == tok.decode(output, skip_special_tokens=skip)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_real_text_in_random_chunks_never_shows_replacement_chars(name, ours, data) -> None:
    """Prompts cut anywhere, even inside a character: the output then shows that character whole."""
    tok = ours[name]
    ids = tok.encode(TEXT)
    cut = data.draw(st.integers(1, len(ids) - 1), label="prompt length")
    prompt, output = ids[:cut], ids[cut:]
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(output), max_size=len(output)), label="chunks")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    chunks = [output[a : a + n] for a, n in zip(starts, sizes) if a < len(output)]
    deltas, detok = stream(tok, prompt, chunks)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == reference(tok, prompt, output)
    assert tok.decode(complete_prefix(tok, prompt)) + detok.text == TEXT


@pytest.mark.parametrize("name", NAMES)
def test_multibyte_characters_appear_whole(name, ours) -> None:
    tok = ours[name]
    output = tok.encode(" 😀你好 é", add_special_tokens=False)
    deltas, _ = stream(tok, tok.encode("Hi"), [[t] for t in output])
    assert "".join(deltas) == reference(tok, tok.encode("Hi"), output)
    assert not any("\ufffd" in d for d in deltas)
    assert {"😀", "你", "好", "é"} <= set("".join(deltas))


def test_sentencepiece_first_token_keeps_its_leading_space(ours) -> None:
    tok = ours["spm"]
    prompt, output = tok.encode("Hello"), tok.encode("Hello world", add_special_tokens=False)[1:]
    assert tok.convert_ids_to_tokens(output)[0].startswith("▁")
    assert tok.decode(output) == "world"  # decoded alone, sentencepiece drops the space
    deltas, _ = stream(tok, prompt, [[t] for t in output])
    assert "".join(deltas) == " world" == reference(tok, prompt, output)


def test_sentencepiece_space_survives_a_skipped_special_token(ours) -> None:
    tok = ours["spm"]
    hello, world = (tok.encode(w, add_special_tokens=False) for w in ("Hello", "world"))
    output = hello + [tok.eos_token_id] + world
    deltas, _ = stream(tok, tok.encode("Say:"), [[t] for t in output])
    assert "".join(deltas) == " Hello world" == reference(tok, tok.encode("Say:"), output)
    # a prompt whose tail is only skipped tokens still gives the context a visible token
    prompt = tok.encode("Say:") + [tok.eos_token_id] * 8
    deltas, _ = stream(tok, prompt, [[t] for t in world])
    assert "".join(deltas) == " world" == reference(tok, prompt, world)


def test_byte_fallback_run_is_held_until_it_ends(ours) -> None:
    tok = ours["spm"]
    run = [t for t in tok.encode("😀", add_special_tokens=False) if t in tok.byte_pieces]
    assert tok.convert_ids_to_tokens(run) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert [detok.push([t]) for t in run] == ["", "", "", ""]
    assert detok.flush() == "😀"
    # an invalid run: the full decode has one U+FFFD per byte, and so does the stream
    a = tok.encode("😀a", add_special_tokens=False)[-1]  # "a" without sentencepiece's space
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert detok.push(run[:2]) == ""
    assert detok.push([a]) == tok.decode(run[:2] + [a]) == "\ufffd\ufffda"


@pytest.mark.parametrize("name", NAMES)
def test_trailing_incomplete_character_is_released_by_flush(name, ours) -> None:
    tok = ours[name]
    output = tok.encode("ok 你", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    detok.push(output[:-1])
    assert "\ufffd" not in detok.text
    assert detok.flush().endswith("\ufffd")
    assert detok.text == reference(tok, tok.encode("x"), output[:-1])
    assert detok.flush() == ""


def test_special_tokens_shown_when_not_skipped(ours) -> None:
    tok = ours["chatml"]
    output = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    deltas, _ = stream(tok, tok.encode("x"), [output], skip=False)
    assert "".join(deltas) == "<|im_start|>hi<|im_end|>"
    deltas, _ = stream(tok, tok.encode("x"), [output], skip=True)
    assert "".join(deltas) == "hi"


def test_empty_prompt(ours) -> None:
    tok = ours["spm"]
    output = tok.encode("Hello world 😀")
    deltas, _ = stream(tok, [], [[t] for t in output])
    assert "".join(deltas) == tok.decode(output) == "Hello world 😀"


@pytest.mark.parametrize("name", NAMES)
def test_cost_per_token_is_a_window_not_the_whole_output(name, ours, monkeypatch) -> None:
    """The longest decode call does not grow with the output (it spans the longest character or byte run)."""
    tok = ours[name]
    decode = tok.decode
    longest = 0

    def counting_decode(ids, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(ids))
        return decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    windows = []
    for repeats in (2, 40):
        longest = 0
        output = tok.encode(TEXT * repeats, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("prompt " * 50))
        for token in output:
            detok.push([token])
        detok.flush()
        windows.append(longest)
        assert detok.text == reference(tok, tok.encode("prompt " * 50), output)
    assert len(output) > 1000
    assert windows[0] == windows[1] <= 40


class CountingTokenizer:
    """A conveyor Tokenizer that counts the window decodes a detokenizer asks it for."""

    def __init__(self, base) -> None:
        self._base = base
        self.decodes = 0

    def __getattr__(self, name: str):
        return getattr(self._base, name)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self._base.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fast_paths_give_the_window_decodes_deltas(name, ours, data) -> None:
    """Delta for delta, push for push: the pieces and byte mode give exactly what decoding the
    window gives, on random ids mixing real text, partial characters (byte-level tokens of
    part of a character, byte-fallback pieces), special and unknown ids, in random chunks."""
    tok = ours[name]
    real = tok.encode(TEXT, add_special_tokens=False)
    odd = sorted(tok.skipped_ids) + sorted(tok.byte_pieces)[:40] + [tok.vocab_size, tok.vocab_size + 2]
    ids = st.one_of(
        st.sampled_from(real), st.sampled_from(real), st.integers(0, tok.vocab_size - 1), st.sampled_from(odd)
    )
    prompt = data.draw(st.one_of(st.sampled_from(PROMPTS).map(tok.encode), st.lists(ids, max_size=8)), label="prompt")
    if data.draw(st.booleans(), label="real run"):
        start = data.draw(st.integers(0, len(real) - 1), label="start")
        output = real[start : start + data.draw(st.integers(1, 40), label="length")]
    else:
        output = data.draw(st.lists(ids, min_size=1, max_size=40), label="output")
    skip = data.draw(st.booleans(), label="skip")
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    window = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, fast_paths=False)
    i = 0
    while i < len(output):
        n = data.draw(st.integers(1, 3), label="chunk")
        chunk = output[i : i + n]
        i += n
        got = fast.push_one(chunk[0]) if len(chunk) == 1 else fast.push(chunk)
        assert got == window.push(chunk), (chunk, fast.text, window.text)
    assert fast.flush() == window.flush()
    assert fast.text == window.text


@pytest.mark.parametrize("name", NAMES)
def test_plain_text_streams_without_window_decodes(name, ours) -> None:
    """Once each token's piece is known, ordinary text costs no decode at all; with byte-level
    BPE, neither do characters split over several tokens (byte mode)."""
    tok = CountingTokenizer(ours[name])
    text = "The quick brown fox jumps over the lazy dog. "
    if name in BYTE_LEVEL:
        text += "Le café est déjà prêt. 你好世界 😀 🎉"
    output = tok.encode(text, add_special_tokens=False)
    IncrementalDetokenizer(tok, tok.encode("x")).push(output)  # fills the memos
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    before = tok.decodes
    deltas = [detok.push_one(t) for t in output] + [detok.flush()]
    assert tok.decodes == before
    assert "".join(deltas) == reference(tok, tok.encode("x"), output)


def test_window_mode_without_a_piecewise_decoder(ours, tokenizer_dirs) -> None:
    """A decoder the fast paths do not know (here Metaspace's own) streams by the window alone."""
    from tokenizers import decoders

    from conveyor.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dirs["spm"])
    tok._backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = Tokenizer(tok._backend, {"bos_token": "<s>", "eos_token": "</s>"})
    assert not tok.streams_by_piece and not tok.streams_by_bytes
    output = tok.encode("Hello world, déjà vu", add_special_tokens=False)
    counting = CountingTokenizer(tok)
    deltas, detok = stream(counting, tok.encode("Say:"), [[t] for t in output])
    assert counting.decodes >= len(output)
    assert "".join(deltas) == reference(tok, tok.encode("Say:"), output)
