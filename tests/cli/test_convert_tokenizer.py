"""bin/convert-tokenizer on a real sentencepiece model (the README's case: a checkpoint with
only ``tokenizer.model``). A tiny Llama-style model (identity normalization, byte fallback,
digits split, as Llama 2 trains its own) is trained here in-process, converted, and the
written ``tokenizer.json`` must tokenize as transformers' slow sentencepiece tokenizer does
and as the frontend's reference (transformers' ``AutoTokenizer``) does."""

from __future__ import annotations

import io
import json

import pytest
import sentencepiece as spm  # the convert extra's; the test extra has it too

from conveyor.cli import convert_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny sentencepiece model.",
    "Conveyor serves language models with continuous batching.",
    "Numbers 12345 and punctuation!? are here too.",
]
# Words seen and unseen, runs of spaces, newlines and tabs, digits, characters outside the
# training text (byte fallback).
TEXTS = [
    "The quick brown fox",
    "Hello   world!",
    "unseen wörds 日本 and 99 bottles",
    "a\nnewline\n\nand\ttab",
    "Conveyor batching, continuously.",
]
# transformers 5's LlamaTokenizer prepends no ``▁`` to text that already starts with a space,
# where sentencepiece does (docs in conveyor.frontend.tokenizer): those texts are checked
# against transformers alone.
LEADING_SPACE = [" leading space", "  two spaces"]


@pytest.fixture(scope="module")
def sentencepiece_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("spm-checkpoint")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_converts_a_sentencepiece_model_to_the_same_token_ids(sentencepiece_checkpoint, capsys) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    assert convert_tokenizer.main([str(sentencepiece_checkpoint)]) == 0
    assert "wrote" in capsys.readouterr().out
    converted = Tokenizer.from_file(str(sentencepiece_checkpoint / "tokenizer.json"))
    slow = SentencePieceBackend(vocab_file=str(sentencepiece_checkpoint / "tokenizer.model"))
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_checkpoint / "tokenizer.model"))
    for text in TEXTS:
        ids = converted.encode(text, add_special_tokens=False).ids
        assert ids == slow.encode(text, add_special_tokens=False) == processor.encode(text), text
        assert converted.decode(ids) == text
    reference = AutoTokenizer.from_pretrained(sentencepiece_checkpoint)
    for text in TEXTS + LEADING_SPACE:
        assert converted.encode(text).ids == reference.encode(text), text


def test_the_frontend_serves_the_converted_tokenizer(sentencepiece_checkpoint) -> None:
    """What serving reads: conveyor's tokenizer on the converted files encodes as transformers."""
    from transformers import AutoTokenizer

    from conveyor.frontend.tokenizer import Tokenizer

    if not (sentencepiece_checkpoint / "tokenizer.json").exists():
        assert convert_tokenizer.main([str(sentencepiece_checkpoint)]) == 0
    ours = Tokenizer.from_dir(sentencepiece_checkpoint)
    reference = AutoTokenizer.from_pretrained(sentencepiece_checkpoint)
    for text in TEXTS + LEADING_SPACE:
        assert ours.encode(text) == reference.encode(text), text


def test_an_existing_tokenizer_json_is_kept(sentencepiece_checkpoint, capsys) -> None:
    target = sentencepiece_checkpoint / "tokenizer.json"
    target.write_text("{}")
    assert convert_tokenizer.main([str(sentencepiece_checkpoint)]) == 1
    assert "--force" in capsys.readouterr().err and target.read_text() == "{}"
    assert convert_tokenizer.main([str(sentencepiece_checkpoint), "--force"]) == 0
