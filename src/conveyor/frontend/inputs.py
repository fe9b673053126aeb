"""A generate request's input as the token ids of its whole context, checked against the model.

Two steps, kept apart so the frontend can time the first alone: :func:`encode_input` turns
the request's input (a prompt, chat messages through the tokenizer's chat template, or token
ids as given) into ids; :func:`context_ids` puts a continuation's earlier context in front
and applies the protocol's context rules (:func:`conveyor.protocol.validation.check_tokenized`).
The frontend's intake (:mod:`conveyor.frontend.intake`) and the in-process engine
(:mod:`conveyor.engine`) both prepare prompts here, so a request is read the same way by
either. Pure functions of their arguments: safe on a tokenizer pool thread.
"""

from __future__ import annotations

import msgspec

from conveyor.frontend.tokenizer import Tokenizer
from conveyor.protocol import requests as client_requests
from conveyor.protocol import validation, wire


def encode_input(
    tokenizer: Tokenizer, req: client_requests.GenerateRequest, continuing: bool, release_gil: bool = False
) -> list[int]:
    """The request's input as token ids. A continuation's input follows earlier tokens, so
    no BOS is added to text, and a chat template's leading BOS is dropped. Messages are
    rendered with the request's ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs`` and ``tools`` (the template's ``tools`` variable);
    ``truncate_prompt_tokens`` then keeps the input's last k ids (the newest text, as vLLM
    truncates). A failure to tokenize (a template error) is the client's input, raised as
    ProtocolError."""
    try:
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt, add_special_tokens=not continuing, release_gil=release_gil)
        elif req.messages is not None:
            ids = tokenizer.apply_chat_template(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                variables=req.chat_template_kwargs
                if req.tools is None
                else {**req.chat_template_kwargs, "tools": req.tools},
                release_gil=release_gil,
            )
            bos = tokenizer.bos_token_id
            if continuing and ids and bos is not None and ids[0] == bos:
                ids = ids[1:]
        else:
            ids = list(req.token_ids)
    except wire.ProtocolError:
        raise
    except Exception as exc:
        raise wire.ProtocolError(f"cannot tokenize input: {exc}", req.request_id, wire.INVALID_INPUT) from None
    k = req.truncate_prompt_tokens
    return ids[-k:] if k is not None and len(ids) > k else ids


def input_chars(req: client_requests.GenerateRequest) -> int:
    """Characters to tokenize: the prompt, or every string the chat template is given: the
    messages' strings, the ``tools`` (keys too: templates write them as JSON) and the
    ``chat_template_kwargs`` (0 for token ids). At any depth: the size check that reads this
    bounds the rendering and tokenizing of everything a template sees, not only the turns'
    text (a 5 MB tool list behind one short message was rendered whole on the loop)."""
    if req.prompt is not None:
        return len(req.prompt)
    if req.messages is None:
        return 0
    return _text_len(req.messages, False) + _text_len(req.tools, True) + _text_len(req.chat_template_kwargs, True)


def _text_len(value, keys: bool) -> int:
    """Total length of the strings in ``value`` at any depth (``keys``: map keys too).
    Iterative, so no nesting the decoder allows can exhaust the stack; linear in the items."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if keys:
                total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_input_chars(
    req: client_requests.GenerateRequest, chars: int, history_len: int, max_model_len: int, max_chars_per_token: int
) -> None:
    """Refuse, before tokenizing it, an input of ``chars`` characters that cannot fit the
    model: with ``history_len`` tokens of earlier turns in front, at most ``max_model_len -
    history_len`` tokens are left, and text longer than that many times
    :attr:`Tokenizer.max_chars_per_token` has more tokens than that. So the work (and memory)
    one request's tokenization can take is bounded by the model length, whatever its size;
    what passes is checked exactly once tokenized (:func:`context_ids`)."""
    limit = max(0, max_model_len - history_len) * max_chars_per_token
    if chars > limit:
        raise wire.ProtocolError(
            f"{'messages (with tools)' if req.messages is not None else 'prompt'} of {chars} characters cannot fit "
            f"the model length {max_model_len}"
            + (f" after {history_len} tokens of earlier turns" if history_len else "")
            + f": at most {limit} characters ({max_chars_per_token} per token at most for this tokenizer)",
            req.request_id,
            wire.PROMPT_TOO_LONG,
        )


def context_ids(
    req: client_requests.GenerateRequest,
    history: list[int] | None,
    input_ids: list[int],
    *,
    vocab_size: int,
    max_model_len: int,
    tokenizer_vocab_size: int,
) -> list[int]:
    """The whole context to run (``history``, a continued request's earlier turns, then
    ``input_ids``), or ProtocolError when the model cannot run it. Ids the tokenizer made
    are in the model's vocabulary unless the tokenizer has more tokens than the model has
    rows (``tokenizer_vocab_size > vocab_size``), so only then, or for ids the client gave,
    is each id checked. A ``fill_context`` request sent without ``max_tokens`` gets the room
    the context leaves (at least 1, so a context that fills the model is refused for its
    length) as its ``max_tokens`` here, in ``req.sampling``."""
    check_ids = req.token_ids is not None or tokenizer_vocab_size > vocab_size
    prompt_ids = history + input_ids if history is not None else input_ids
    if req.fill_context:
        req.sampling = msgspec.structs.replace(req.sampling, max_tokens=max(1, max_model_len - len(prompt_ids)))
    validation.check_tokenized(req, prompt_ids, vocab_size, max_model_len, check_ids=check_ids)
    return prompt_ids
