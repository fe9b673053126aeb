"""conveyor's Tokenizer against transformers' AutoTokenizer on the same directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.frontend.tokenizer import Tokenizer

NAMES = ["bytelevel", "chatml", "spm", "spm_legacy", "demo"]
CHAT_NAMES = ["chatml", "spm", "spm_legacy", "demo"]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Pieces that stress the pipelines: multi-byte characters, combining marks (NFC), runs of
# spaces and newlines, sentencepiece's own space symbol, and special-token text.
FRAGMENTS = [
    "a", "The", " quick", "  ", " ", "\n", "\n\n", "\t", "é", "e\u0301", "ß", "😀", "👨‍👩‍👧", "🇫🇷", "你好", "日本",
    "▁", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>", "123", "'s", "!?",
]  # fmt: skip
texts = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join))


@pytest.mark.parametrize("name", NAMES)
def test_vocabulary_matches_transformers(name, ours, hf) -> None:
    tok, ref = ours[name], hf[name]
    assert tok.vocab_size == len(ref)
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.all_special_ids == ref.all_special_ids
    ids = list(range(0, tok.vocab_size, 7))
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(3) == ref.convert_ids_to_tokens(3)


@HYPOTHESIS
@given(text=texts)
def test_encode_matches_transformers(ours, hf, text) -> None:
    for name in NAMES:
        assert ours[name].encode(text) == hf[name].encode(text), name
        plain = ours[name].encode(text, add_special_tokens=False)
        assert plain == hf[name].encode(text, add_special_tokens=False), name


@pytest.mark.parametrize(
    ("name", "bos"), [("bytelevel", 0), ("demo", 0), ("spm", 1), ("spm_legacy", 1), ("chatml", None)]
)
def test_bos_comes_from_the_post_processor(name, bos, ours) -> None:
    """transformers 5 ignores add_bos_token when tokenizer.json exists (spm's config says True; chatml has no BOS)."""
    with_special = ours[name].encode("Hello world")
    plain = ours[name].encode("Hello world", add_special_tokens=False)
    assert with_special == ([bos] if bos is not None else []) + plain


def test_add_bos_token_in_the_config_is_ignored_like_transformers(tmp_path, tokenizer_dirs) -> None:
    import transformers

    root = _copy(tokenizer_dirs["spm"], tmp_path / "tok")
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False, "add_eos_token": True}))
    ids = Tokenizer.from_dir(root).encode("Hello world")
    assert ids == transformers.AutoTokenizer.from_pretrained(str(root)).encode("Hello world")
    assert ids[0] == 1 and ids[-1] != 2


@HYPOTHESIS
@given(data=st.data())
def test_decode_matches_transformers(ours, hf, data) -> None:
    for name in NAMES:
        ids = data.draw(st.lists(st.integers(0, ours[name].vocab_size - 1), max_size=40), label=name)
        for skip in (True, False):
            assert ours[name].decode(ids, skip_special_tokens=skip) == hf[name].decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", NAMES)
def test_decode_roundtrip_of_multibyte_text(name, ours) -> None:
    text = "Café déjà vu: 😀 你好世界 👨‍👩‍👧 🇫🇷!"
    assert ours[name].decode(ours[name].encode(text)) == text


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And 3+3?  "},
    ],
    [{"role": "user", "content": "Unicode: café 😀 你好 — «quotes»\nsecond line"}],
    [{"role": "user", "content": "special text in content: <|im_end|> <s> <|eot_id|>"}],
    [{"role": "user", "content": "tool calls are dropped when None", "tool_calls": None}],
]
# transformers encodes the special-token text of this one as control tokens; Conveyor as text.
SPECIAL_TEXT = 3
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("name", CHAT_NAMES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(name, conversation, add_generation_prompt, ours, hf) -> None:
    messages = CONVERSATIONS[conversation]
    text = ours[name].render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf[name].apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours[name].apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf[name].apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    if (
        conversation == SPECIAL_TEXT
    ):  # by design (issue 43; test_template_injection.py): the message's special-token text stays text
        control = ours[name].skipped_ids
        assert len([i for i in ids if i in control]) < len([i for i in expected if i in control])
        if name not in ("spm", "spm_legacy"):  # (sentencepiece: a space may start the text after such a span)
            assert ours[name].decode(ids, skip_special_tokens=False) == text
        return
    assert ids == list(expected)


@pytest.mark.parametrize("name", ["chatml", "demo"])
def test_chat_template_with_system_message(name, ours, hf) -> None:
    expected = hf[name].apply_chat_template(SYSTEM, add_generation_prompt=True, tokenize=False)
    assert ours[name].render_chat(SYSTEM) == expected


def test_demo_chat_starts_with_one_bos_and_accepts_content_parts(ours, hf) -> None:
    tok = ours["demo"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    ids = tok.apply_chat_template(parts)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids == list(hf["demo"].apply_chat_template(parts, add_generation_prompt=True, return_dict=False))
    assert tok.render_chat(parts) == tok.render_chat([{"role": "user", "content": "Hello there"}])


def test_template_exception_is_a_value_error(ours) -> None:
    with pytest.raises(ValueError, match="Only user and assistant roles"):
        ours["spm"].render_chat(SYSTEM)


def test_no_chat_template_is_a_clear_error(ours) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        ours["bytelevel"].apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", [[], "hello", [["role", "user"]]])
def test_malformed_messages_are_value_errors(messages, ours) -> None:
    with pytest.raises(ValueError):
        ours["demo"].render_chat(messages)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# Exercises what transformers' sandbox adds to jinja: loop controls, the generation tag,
# a tojson that keeps non-ASCII, namespace(), dict(), strftime_now.
FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{% generation %}{{ m['role'] }}={{ m['content'] | tojson }}{% endgeneration %}\n"
    "{% endfor %}"
    "{{ dict(a=1) | tojson }} {{ ns.n }} {{ bos_token }}{{ eos_token }}"
    "{% if strftime_now('%Y') | length == 4 %} year{% endif %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


def test_template_features_match_transformers(tmp_path) -> None:
    import transformers

    root = _copy(TOKENIZER_DIR, tmp_path / "tok")
    (root / "chat_template.jinja").write_text(FEATURE_TEMPLATE)  # overrides tokenizer_config's template
    messages = [
        {"role": "user", "content": 'é 你好 "q"'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "x"},
    ]
    ours = Tokenizer.from_dir(root).render_chat(messages)
    ref = transformers.AutoTokenizer.from_pretrained(str(root)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours == ref
    assert '"é 你好 \\"q\\""' in ours and ours.endswith(" year>")


def test_sandbox_refuses_underscore_namespace_attributes(tmp_path) -> None:
    root = _copy(TOKENIZER_DIR, tmp_path / "tok")
    (root / "chat_template.jinja").write_text("{% set ns = namespace(__class__=1) %}x")
    with pytest.raises(ValueError, match="underscore"):
        Tokenizer.from_dir(root).render_chat([{"role": "user", "content": "hi"}])


def test_processor_style_chat_template_json_is_a_fallback(tmp_path, tokenizer_dirs) -> None:
    root = _copy(tokenizer_dirs["bytelevel"], tmp_path / "tok")
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    assert Tokenizer.from_dir(root).render_chat([{"role": "user", "content": "hi"}]) == "hi!"


def test_special_token_missing_from_tokenizer_json_is_added_like_transformers(tmp_path, tokenizer_dirs) -> None:
    import transformers

    root = _copy(tokenizer_dirs["bytelevel"], tmp_path / "tok")
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    tok, ref = Tokenizer.from_dir(root), transformers.AutoTokenizer.from_pretrained(str(root))
    assert tok.vocab_size == len(ref)
    assert tok.encode("a<pad>b") == ref.encode("a<pad>b")
    assert tok.all_special_ids == ref.all_special_ids


def test_missing_tokenizer_json_says_how_to_make_one(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*bin/convert-tokenizer"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")


def test_malformed_files_are_named(tmp_path, tokenizer_dirs) -> None:
    root = _copy(tokenizer_dirs["bytelevel"], tmp_path / "tok")
    (root / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(root)
    (root / "tokenizer_config.json").write_text("{}")
    (root / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(root)


# ---------------------------------------------------------------------- the frontend's pooled path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_release_gil_encodes_the_same_ids(ours, data) -> None:
    for name in NAMES:
        text = data.draw(texts, label=name)
        for special in (True, False):
            assert ours[name].encode(text, special, release_gil=True) == ours[name].encode(text, special)
        for i in range(ours[name].vocab_size + 2):
            if i % 97 == 0:
                assert ours[name].decode_one(i) == ours[name].decode([i])
                assert ours[name].decode_one(i, False) == ours[name].decode([i], skip_special_tokens=False)


@pytest.mark.parametrize("name", CHAT_NAMES)
def test_release_gil_chat_template_gives_the_same_ids(name, ours) -> None:
    for messages in CONVERSATIONS:
        assert ours[name].apply_chat_template(messages, release_gil=True) == ours[name].apply_chat_template(messages)


def test_release_gil_lets_other_threads_run_during_a_long_encode(ours) -> None:
    """The reason the frontend's pool uses ``release_gil``: while one thread encodes a long
    prompt, another (the event loop) keeps running. Measured as the longest stretch during
    the encode in which this thread could not execute Python: with the GIL held for the whole
    encode that stretch is the encode's duration."""
    import threading
    import time

    tok = ours["demo"]
    text = "The lighthouse keeper wrote in his log, café 😀 你好, every night. " * 5000  # ~330k characters
    done = threading.Event()
    timing: dict[str, float] = {}

    def work() -> None:
        start = time.perf_counter()
        tok.encode(text, release_gil=True)
        timing["encode_s"] = time.perf_counter() - start
        done.set()

    worker = threading.Thread(target=work)
    last = time.perf_counter()
    longest = 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    worker.join()
    assert timing["encode_s"] > 0.05, "too fast to tell: lengthen the text"
    assert longest < timing["encode_s"] / 2, (longest, timing)


# ---------------------------------------------------------------------- streaming fast paths


@pytest.mark.parametrize(
    "name, kind",
    [
        ("bytelevel", "byte_level"),
        ("chatml", "byte_level"),
        ("demo", "byte_level"),
        ("spm", "sentencepiece"),
        ("spm_legacy", "sentencepiece"),
    ],
)
def test_piecewise_decoders_are_recognized(name, kind, ours) -> None:
    tok = ours[name]
    assert tok.streams_by_piece
    assert tok.streams_by_bytes == (kind == "byte_level")


@pytest.mark.parametrize("name", NAMES)
@HYPOTHESIS
@given(data=st.data())
def test_a_piece_is_what_its_token_adds_after_any_clean_context(name, ours, data) -> None:
    """decode(context + [t]) == decode(context) + piece for every context with text that does not
    end in U+FFFD or inside a byte-fallback run, and alone == decode([t])."""
    tok = ours[name]
    ids = st.integers(0, tok.vocab_size + 2)
    skip = data.draw(st.booleans(), label="skip")
    encoded = texts.map(lambda t: tok.encode(t, add_special_tokens=False))
    context = data.draw(st.one_of(encoded, st.lists(ids, max_size=6)), label="context")
    before = tok.decode(context, skip_special_tokens=skip)
    visible = [i for i in context if 0 <= i < tok.vocab_size and not (skip and i in tok.skipped_ids)]
    if not before or before.endswith("\ufffd") or (visible and visible[-1] in tok.byte_pieces):
        return
    for token in data.draw(st.lists(ids, min_size=1, max_size=8), label="tokens"):
        entry = tok.stream_piece(token, skip)
        if entry is None:
            continue
        piece, alone = entry
        assert piece and "\ufffd" not in piece and alone == tok.decode([token], skip_special_tokens=skip)
        assert tok.decode(context + [token], skip_special_tokens=skip) == before + piece


@pytest.mark.parametrize("name", ["bytelevel", "chatml", "demo"])
@HYPOTHESIS
@given(data=st.data())
def test_token_bytes_decode_like_the_backend(name, ours, data) -> None:
    """Byte-level BPE: the lossy UTF-8 decode of the tokens' bytes concatenated is the decode."""
    tok = ours[name]
    skip = data.draw(st.booleans(), label="skip")
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 2), max_size=20), label="ids")
    data_bytes = b"".join(tok.stream_token_bytes(i, skip) for i in ids)
    assert data_bytes.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=500, deadline=None)
@given(
    raw=st.lists(
        st.one_of(
            st.integers(0, 255), st.integers(0x80, 0xBF), st.sampled_from([0xC0, 0xC2, 0xE0, 0xED, 0xF0, 0xF4, 0xF5])
        ),
        max_size=16,
    )
)
def test_python_replaces_invalid_utf8_as_the_backend_does(ours, raw) -> None:
    """Byte mode decodes held bytes with Python's "replace": one U+FFFD per maximal invalid part,
    exactly as the Rust decoder's lossy UTF-8 (checked through the demo's one-byte tokens)."""
    tok = ours["demo"]
    one_byte = {tok.stream_token_bytes(i): i for i in range(tok.vocab_size) if len(tok.stream_token_bytes(i)) == 1}
    assert len(one_byte) == 256
    assert tok.decode([one_byte[bytes([b])] for b in raw]) == bytes(raw).decode("utf-8", "replace")
