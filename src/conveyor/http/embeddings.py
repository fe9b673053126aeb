"""``POST /v1/embeddings``: OpenAI's embeddings request as pooling requests, and its answer.

The body's ``input`` (a string, strings, token ids, or lists of token ids) becomes one
client-protocol request per input with ``pooling`` set (:mod:`conveyor.worker.pooling`):
prompt-only, run in the same steps as generations, their KV given back once the prompt has
run. ``pooling`` (a Conveyor field: ``last``, the default, as vLLM pools decoder models; or
``mean``) picks the pooling; vectors are L2-normalized. ``encoding_format`` ``float`` gives
lists of floats, ``base64`` the little-endian float32 bytes in base64 (what the openai SDK
asks for by default). ``dimensions`` (truncation) is refused: no served model is trained for
shortened vectors. ``user`` is ignored; ``truncate_prompt_tokens`` and ``priority`` are
vLLM's, passed on; a field the table lacks is reported (a 400 with ``--strict-fields``).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

from conveyor.http.errors import ApiError, bad_field
from conveyor.http.openai_requests import MAX_PROMPTS, GenerationJob, _check_model, unknown_fields
from conveyor.protocol.sampling_fields import POOLING_METHODS

EMBEDDING = "embedding"
# What this endpoint reads; "user" is accepted and ignored, as OpenAI's own attribution field.
_KNOWN = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user", "pooling", "truncate_prompt_tokens", "priority"}
)
_FORWARDED = ("truncate_prompt_tokens", "priority")
_INPUT_SHAPE = "'input' must be a string, an array of strings, an array of token ids or an array of arrays of token ids"


def embeddings_job(
    body: Any, served_model: str, loras: Sequence[str] = (), strict: bool = False
) -> tuple[GenerationJob, str]:
    """The pooling requests of an embeddings body and its ``encoding_format``; ApiError
    (400 naming the field, 404 for an unknown model) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = unknown_fields(body, _KNOWN, strict)
    lora = _check_model(body.get("model"), served_model, loras)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_field("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {encoding!r}")
    if body.get("dimensions") is not None:
        raise bad_field(
            "dimensions",
            "'dimensions' (shortened embeddings) is not supported: drop it; vectors have the model's hidden size",
        )
    pooling = body.get("pooling") or "last"
    if pooling not in POOLING_METHODS:
        raise bad_field("pooling", f"'pooling' must be one of {', '.join(map(repr, POOLING_METHODS))}, got {pooling!r}")
    options: dict[str, Any] = {"pooling": pooling, "max_tokens": 1}
    options.update({name: body[name] for name in _FORWARDED if body.get(name) is not None})
    if lora is not None:
        options["lora"] = lora
    ignored = tuple(sorted([*unknown, *(["user"] if body.get("user") is not None else [])]))
    job = GenerationJob(EMBEDDING, _inputs(body.get("input")), options, False, False, ignored, unknown=unknown)
    return job, encoding


def _inputs(value: Any) -> list[dict[str, Any]]:
    """One protocol input per embedding input."""
    if value is None:
        raise bad_field("input", "'input' is required")
    if isinstance(value, str):
        return [{"prompt": value}]
    if not isinstance(value, list) or not value:
        raise bad_field("input", _INPUT_SHAPE + (", got an empty array" if value == [] else ""))
    if all(_is_int(t) for t in value):
        return [{"token_ids": value}]
    if len(value) > MAX_PROMPTS:
        raise bad_field("input", f"at most {MAX_PROMPTS} inputs per request, got {len(value)}")
    if all(isinstance(v, str) for v in value):
        return [{"prompt": v} for v in value]
    if all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
        return [{"token_ids": v} for v in value]
    raise bad_field("input", _INPUT_SHAPE)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embeddings_body(results: Sequence[Any], model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings list for the finals ``results`` (in input order)."""
    data = []
    for index, result in enumerate(results):
        vector = result.embedding
        if encoding == "base64":
            value: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        else:
            value = vector
        data.append({"object": "embedding", "index": index, "embedding": value})
    prompt_tokens = sum(result.usage.prompt_tokens for result in results)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
