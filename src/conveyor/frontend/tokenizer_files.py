"""Reading a checkpoint's tokenizer files: what :meth:`conveyor.frontend.tokenizer.Tokenizer.from_dir`
builds a tokenizer from, as transformers 5 reads the same files.

``tokenizer.json`` itself (:func:`tokenizer_file`), ``tokenizer_config.json`` (:func:`read_json`),
its special-token entries (:func:`token_content`), the tokens it declares that ``tokenizer.json``
lacks (:func:`add_missing_tokens`), the pipeline ``LlamaTokenizer`` rebuilds
(:func:`rebuild_like_llama_tokenizer`) and the named chat templates (:func:`chat_templates`). Each
mirrors transformers' rule for it (:mod:`conveyor.frontend.tokenizer` says which and why); none
imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer


def tokenizer_file(root: Path) -> Path:
    """``root``'s ``tokenizer.json``, the one file the frontend requires; FileNotFoundError saying
    how to make one when it is missing (bin/serve checks it before any process starts)."""
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist or is not a directory")
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the frontend reads only the fast-tokenizer file. If this checkpoint ships "
            f"a slow tokenizer (tokenizer.model, or vocab.json + merges.txt), run `bin/convert-tokenizer {root}` "
            "(or conveyor-convert-tokenizer) once to write tokenizer.json from it; it needs transformers: "
            'pip install "conveyor[convert]"'
        )
    return path


def read_json(path: Path) -> Any:
    """Parsed JSON at ``path``, or None when there is no such file."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot parse {path}: {exc}") from None


def token_content(value: Any) -> str:
    """A special token's text from a config value: a string or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry in tokenizer_config.json: {value!r}")


def add_missing_tokens(backend: BackendTokenizer, added_tokens_decoder: dict, special: list[str]) -> None:
    """Add tokens the config declares but tokenizer.json lacks, in transformers' order.

    They take the next free ids, as in transformers, so ``vocab_size`` and every id agree with it.
    """
    tokens: list[AddedToken] = []
    seen: set[str] = set()
    for _, entry in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
        content = token_content(entry)
        if backend.token_to_id(content) is None and content not in seen:
            props = entry if isinstance(entry, dict) else {}
            tokens.append(
                AddedToken(
                    content,
                    single_word=bool(props.get("single_word", False)),
                    lstrip=bool(props.get("lstrip", False)),
                    rstrip=bool(props.get("rstrip", False)),
                    normalized=bool(props.get("normalized", not props.get("special", True))),
                    special=bool(props.get("special", True)),
                )
            )
            seen.add(content)
    for content in special:
        if backend.token_to_id(content) is None and content not in seen:
            tokens.append(AddedToken(content, special=True, normalized=False))
            seen.add(content)
    if tokens:
        backend.add_tokens(tokens)


def rebuild_like_llama_tokenizer(backend: BackendTokenizer, config: dict) -> None:
    """Give ``backend`` the normalizer, pre-tokenizer and decoder transformers 5's ``LlamaTokenizer`` builds.

    That class keeps only the vocabulary, merges and post-processor of tokenizer.json: no
    normalizer, a Metaspace pre-tokenizer over the whole text that prepends ``▁`` only at
    the very start (or never, without ``add_prefix_space``), and the matching decoder.
    """
    if not isinstance(backend.model, models.BPE):
        return  # that class only knows BPE; anything else is used as saved
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if config.get("legacy") else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def chat_templates(root: Path, config: dict) -> dict[str, str]:
    """Named chat templates, ``default`` being the one used without a name.

    Precedence as in transformers: template files (``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja``) replace any template in tokenizer_config.json.
    A processor-style ``chat_template.json`` is the last resort.
    """
    files: dict[str, str] = {}
    default_file = root / "chat_template.jinja"
    if default_file.is_file():
        files["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in entry}
    legacy = read_json(root / "chat_template.json")
    if isinstance(legacy, dict) and isinstance(legacy.get("chat_template"), str):
        return {"default": legacy["chat_template"]}
    return {}
