"""Train the demo model's tokenizer: ``python -m conveyor.checkpoints.demo.build_tokenizer``.

The demo model must run with nothing downloaded, yet exercise every real path of the
frontend (byte-level BPE, multi-byte UTF-8 split across tokens, special tokens, a chat
template), so its tokenizer is a real one, trained here and committed beside this file as
``tokenizer.json`` and ``tokenizer_config.json``. It is shaped like Llama 3's: the same
pre-tokenization split, byte-level BPE, ``<|begin_of_text|>`` added by the post-processor,
and header/eot chat markers.

The corpus is the docstrings of the running interpreter's top-level standard-library
modules (English prose, read offline) plus a short multilingual sample, so that accented
letters, CJK and emoji get merges too. Training is deterministic for a given interpreter
and ``tokenizers`` version; a different Python ships different docstrings and so gives a
different (equally valid) vocabulary, which is why the outputs are committed rather than
rebuilt on demand.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 4096
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT]

# Llama 3's pre-tokenization split: contractions, letter runs with one leading non-letter,
# digits in groups of at most three, punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Header/eot turns like Llama 3's. Content may be a string or a list of typed parts
# (only the text parts are rendered). BOS is written by the template, so a chat is encoded
# with add_special_tokens=False and starts with exactly one BOS.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '"
    + START_HEADER
    + "' + message['role'] + '"
    + END_HEADER
    + "\\n\\n' + content | trim + '"
    + EOT
    + "' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '" + START_HEADER + "assistant" + END_HEADER + "\\n\\n' }}\n"
    "{%- endif %}\n"
)

MULTILINGUAL_SAMPLE = """\
Le café est déjà prêt : crème brûlée, façade, naïve, élève, où, garçon, Noël.
Straße, Größe, Übermäßig schön, Fußgängerübergänge, Äpfel und Öl.
¿Dónde está la biblioteca? Mañana será otro día; el niño comió piña.
Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.
Γειά σου κόσμε. Ζαφείρι δέξου πάγκαλο, βαθῶν ψυχῆς τὸ σῆμα.
こんにちは世界。東京は日本の首都です。今日はいい天気ですね。
你好，世界！我们今天学习分词器和语言模型。中文文本需要多字节编码。
안녕하세요 세계. 한국어 문장도 토크나이저가 처리합니다.
مرحبا بالعالم. هذه جملة عربية قصيرة.
שלום עולם. זה משפט קצר בעברית.
नमस्ते दुनिया। यह एक छोटा वाक्य है।
Emoji: 😀 😃 😄 😁 😆 🙂 🙃 😉 👍 👋 🎉 🚀 ❤️ ✨ 🔥 🐍 🌍 👩‍💻 🇫🇷 🇯🇵
Math and symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↔ € £ ¥ © ® ™ ° ± × ÷ … — – « » „ “ ” ‘ ’
"""


def stdlib_docstrings() -> Iterator[str]:
    """Docstrings of the top-level modules in the interpreter's Lib directory, in file-name order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def corpus() -> Iterator[str]:
    yield from stdlib_docstrings()
    for _ in range(20):  # weight the small multilingual sample up against ~1 MB of English
        yield from MULTILINGUAL_SAMPLE.splitlines()


def train_byte_level_bpe(
    texts: Iterable[str],
    split: str,
    specials: list[str],
    vocab_size: int,
    *,
    min_frequency: int = 0,
    nfc: bool = False,
) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 / Qwen shape: ``split`` regex, then bytes) trained on
    ``texts``, with no post-processor yet. ``specials`` get ids 0.. in order; all 256 byte
    symbols are in the vocabulary, so any text encodes. Also builds the tests' tokenizers."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A Llama-3-shaped byte-level BPE trained on :func:`corpus`; special tokens get ids 0-4."""
    tok = train_byte_level_bpe(corpus(), SPLIT_PATTERN, SPECIAL_TOKENS, vocab_size, min_frequency=2)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, tok.token_to_id(BOS))],
            ),
        ]
    )
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """tokenizer_config.json as transformers reads it (PreTrainedTokenizerFast over tokenizer.json)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def write(out_dir: Path = HERE) -> tuple[Path, Path]:
    tok = build_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_path = out_dir / "tokenizer.json"
    cfg_path = out_dir / "tokenizer_config.json"
    tok.save(str(tok_path), pretty=False)
    cfg_path.write_text(json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return tok_path, cfg_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help=f"output directory (default: {HERE})")
    args = p.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
