"""How every request field of OpenAI's and vLLM's completion and chat schemas is taken.

:data:`FIELDS` says how every request field of OpenAI's and vLLM's completion and chat
schemas is taken (docs/http.md lists them):

- ``forward``: a client-protocol field (``temperature``, ``seed``, ``stop``, vLLM's
  ``top_k``, ``skip_special_tokens``, ``truncate_prompt_tokens``, ``chat_template_kwargs``
  ...), sent as it came: the frontend validates it (``protocol.requests``) and its refusal
  names the field (mapped to a 400 by :mod:`conveyor.http.errors`), so the rules live in
  one place.
- ``http``: handled by :mod:`conveyor.http.openai_requests` (``model``, the input, ``stream``/``stream_options``,
  ``max_tokens``, ``echo``, ``return_token_ids``, ``logprobs`` / ``top_logprobs``, which
  become the protocol's ``logprobs`` k: completions' ``logprobs`` is k, chat's is a flag
  with ``top_logprobs`` its k; with ``echo``, completions also ask ``prompt_logprobs`` k).
- ``ignored``: no effect on the output here (``user``, ``metadata``, vLLM's ``cache_salt``,
  ``spaces_between_special_tokens`` (the Rust tokenizers join special tokens as they are)
  ...): accepted, and listed in the response header ``x-conveyor-ignored-fields`` and a log
  line, as vLLM does.
- ``inert``: not implemented, and ignoring it would change the output: accepted only with a
  value that asks for nothing (null, or the listed ones), else a 400 naming it. Those marked
  ``later`` (``bad_words``, beam search) become ``forward``
  fields once the worker computes them.

A field in neither schema is ignored and reported like an ``ignored`` one, with a warning
the first time its name is seen (vLLM's behaviour: a client written for another server sends
fields of its own); ``--strict-fields`` makes it a 400 naming it. A field of the other
endpoint (``messages`` on completions) is always a 400.

:mod:`conveyor.http.openai_requests` applies the table to a body; this module is the table
alone (no torch: it runs in the HTTP process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPLETION = "completion"
CHAT = "chat"

FORWARD = "forward"
HTTP = "http"
IGNORED = "ignored"
INERT = "inert"
_BOTH = frozenset({COMPLETION, CHAT})


@dataclass(frozen=True)
class Field:
    """How one request field is taken: ``how`` (FORWARD, HTTP, IGNORED, INERT) on the
    ``endpoints`` that have it; for INERT, the non-null values that ask for nothing per
    endpoint and whether the field is to be implemented (``later``)."""

    how: str
    endpoints: frozenset[str] = _BOTH
    inert: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    later: bool = False


def _inert(*values: Any, later: bool = False, endpoints: frozenset[str] = _BOTH) -> Field:
    return Field(INERT, endpoints, {e: values for e in endpoints}, later)


_C, _CH = frozenset({COMPLETION}), frozenset({CHAT})
FIELDS: dict[str, Field] = {
    # OpenAI, both endpoints
    "model": Field(HTTP),
    "stream": Field(HTTP),
    "stream_options": Field(HTTP),
    "max_tokens": Field(HTTP),
    "max_completion_tokens": Field(HTTP),
    "temperature": Field(FORWARD),
    "top_p": Field(FORWARD),
    "seed": Field(FORWARD),
    "stop": Field(FORWARD),
    "n": Field(FORWARD),  # each input's n sequences are choices input * n .. input * n + n - 1
    "best_of": Field(FORWARD),  # the n most likely of best_of sequences (not streamed)
    "logprobs": Field(HTTP),
    "top_logprobs": Field(HTTP),
    "presence_penalty": Field(FORWARD),
    "frequency_penalty": Field(FORWARD),
    "logit_bias": Field(FORWARD),
    "response_format": Field(HTTP),  # -> constraint (_constraint)
    "user": Field(IGNORED),
    "metadata": Field(IGNORED),
    "store": Field(IGNORED),
    "service_tier": Field(IGNORED),
    "prompt_cache_key": Field(IGNORED),
    "safety_identifier": Field(IGNORED),
    # OpenAI, one endpoint
    "prompt": Field(HTTP, _C),
    "echo": Field(HTTP),  # chat: only false (vLLM's echo of the last message is not done)
    "suffix": _inert("", endpoints=_C),
    "messages": Field(HTTP, _CH),
    "tools": Field(HTTP, _CH),  # forwarded to the chat template; parsed out by --tool-call-parser
    "tool_choice": Field(HTTP, _CH),  # "required" / a named function: a JSON-schema constraint
    "functions": _inert([], endpoints=_CH),
    "function_call": _inert("none", "auto", endpoints=_CH),
    "parallel_tool_calls": Field(IGNORED, _CH),
    "reasoning_effort": _inert(endpoints=_CH),
    "modalities": _inert(["text"], endpoints=_CH),
    "audio": _inert(endpoints=_CH),
    "prediction": _inert(endpoints=_CH),
    "web_search_options": _inert(endpoints=_CH),
    "verbosity": _inert(endpoints=_CH),
    # vLLM's extras, both endpoints
    "top_k": Field(FORWARD),
    "min_p": Field(FORWARD),
    "stop_token_ids": Field(FORWARD),
    "ignore_eos": Field(FORWARD),
    "priority": Field(FORWARD),
    "skip_special_tokens": Field(FORWARD),
    "include_stop_str_in_output": Field(FORWARD),
    "truncate_prompt_tokens": Field(FORWARD),
    "return_token_ids": Field(HTTP),
    "spaces_between_special_tokens": Field(IGNORED),
    "request_id": Field(IGNORED),
    "cache_salt": Field(IGNORED),
    "kv_transfer_params": Field(IGNORED),
    "vllm_xargs": Field(IGNORED),
    "return_tokens_as_token_ids": Field(IGNORED),  # shapes log-probabilities only
    "guided_decoding_backend": Field(IGNORED),  # one engine (llguidance) compiles every constraint
    "guided_whitespace_pattern": Field(IGNORED),
    "use_beam_search": _inert(False, later=True),
    "length_penalty": _inert(1, 1.0),  # beam search only
    "repetition_penalty": Field(FORWARD),
    "min_tokens": Field(FORWARD),
    "bad_words": _inert([], later=True),
    "allowed_token_ids": _inert(),
    "prompt_logprobs": Field(FORWARD),
    "logits_processors": _inert(),
    "guided_json": Field(HTTP),  # these five: at most one, -> constraint (_constraint)
    "guided_regex": Field(HTTP),
    "guided_choice": Field(HTTP),
    "guided_grammar": Field(HTTP),
    "structured_outputs": Field(HTTP),
    "add_special_tokens": Field(INERT, _BOTH, {COMPLETION: (True,), CHAT: (False,)}),
    # vLLM's extras, one endpoint
    "prompt_embeds": _inert(endpoints=_C),
    "add_generation_prompt": Field(FORWARD, _CH),
    "continue_final_message": Field(FORWARD, _CH),
    "chat_template_kwargs": Field(FORWARD, _CH),
    "chat_template": _inert(endpoints=_CH),
    "documents": _inert([], endpoints=_CH),
    "mm_processor_kwargs": Field(IGNORED, _CH),
    "include_reasoning": Field(IGNORED, _CH),  # with --reasoning-parser the reasoning is always returned
    # Conveyor's: the think block's most tokens (conveyor.http.reasoning_budget, with --reasoning-parser)
    "max_reasoning_tokens": Field(HTTP, _CH),
}
