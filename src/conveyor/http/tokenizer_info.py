"""``GET /tokenizer_info``: the served tokenizer's configuration, in vLLM's shape.

vLLM answers with its tokenizer's init arguments (what ``tokenizer_config.json`` holds) less
the file paths (``vocab_file``, ``merges_file``), added tokens written as their text, plus
``tokenizer_class`` and the ``chat_template`` it serves; tools that render prompts themselves
(load generators, eval harnesses, routers) read the special tokens and the template from it.
Conveyor builds the same from the model directory's ``tokenizer_config.json`` and the
template its tokenizer serves (the file's own, or ``chat_template.jinja``), and adds
``vocab_size``, ``bos_token_id`` and ``eos_token_id`` as the frontend resolves them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from conveyor.http.tokens import Tokens

_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "auto_map")


def _plain(value: Any) -> Any:
    """An added token's object (``{"content": ..., "__type": "AddedToken"}``) as its text, anywhere in ``value``."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and ("__type" in value or "special" in value):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return config if isinstance(config, dict) else {}


async def tokenizer_info(tokens: Tokens) -> dict[str, Any]:
    tokenizer = await tokens.tokenizer()  # a 503 without a model directory
    config = await asyncio.to_thread(_config, tokens.model_dir)  # type: ignore[arg-type]
    info = {k: _plain(v) for k, v in config.items() if k not in _PATH_FIELDS}
    info["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    template = tokenizer.chat_template
    if template:
        info["chat_template"] = template
    info.update(
        vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return info
