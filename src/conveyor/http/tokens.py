"""The HTTP process's own copy of the model's tokenizer, for what needs the prompt's tokens
before or beside the frontend's answer: ``/tokenize`` and ``/detokenize``, ``echo`` of a
token-id prompt, ``return_token_ids`` (the prompt's ids) and the prompt count of
``stream_options.continuous_usage_stats``.

The prompt is tokenized by the very functions the frontend uses
(:func:`conveyor.frontend.inputs.encode_input` on the request as
:func:`conveyor.protocol.requests.parse_client_message` reads it), so its ids are the ones the
frontend sends to the scheduler (the HTTP process never continues a request, so there are
no earlier turns). The tokenizer is loaded on first use, on a thread, so a server that never
needs it never pays for it; encoding also runs on a thread (the Rust tokenizer releases the
GIL), so a long prompt does not stall the event loop. Never imports torch.

Size before work: an input is measured as the frontend measures it
(:func:`~conveyor.frontend.inputs.check_input_chars`: at most ``max_model_len`` times the
tokenizer's longest token in characters) before it is rendered or tokenized, and refused
with the frontend's ``prompt_too_long`` 400 past that; so no request makes this process
tokenize more than one model length's worth of text per input (an 8 MB prompt with
``return_token_ids`` used to be tokenized whole: 3.9M tokens, 33 s, gigabytes kept). After a
large input the heap is trimmed, as the frontend does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.frontend.inputs import check_input_chars, encode_input, input_chars
from conveyor.frontend.server import release_freed_memory
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.http.errors import ApiError, from_final_error
from conveyor.protocol import wire
from conveyor.protocol import requests as client_requests


# An input of at least this many characters is large: the heap is trimmed after it.
LARGE_INPUT_CHARS = 64 * 1024


class Tokens:
    """The tokenizer of ``model_dir``, loaded once when first asked for (None: no model
    directory known, every use is a 503); inputs are bounded by ``max_model_len``."""

    def __init__(self, model_dir: str | None, max_model_len: int) -> None:
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self._loading: asyncio.Future[Tokenizer] | None = None

    async def tokenizer(self) -> Tokenizer:
        if self.model_dir is None:
            raise ApiError(503, "this HTTP process was started without the model directory: no tokenizer", code="no_tokenizer")
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_dir, self.model_dir))
        return await asyncio.shield(self._loading)

    async def prompt_ids(self, inputs: dict[str, Any], options: dict[str, Any], add_special_tokens: bool = True) -> list[int]:
        """The token ids the frontend makes of one generate input with these option fields
        (``add_special_tokens`` False: a text prompt without BOS, as a continuation's); the
        frontend's refusal of a bad field or input (too long for the model included) as the
        same 400."""
        tokenizer = await self.tokenizer()
        try:
            req = client_requests.parse_client_message({"type": wire.GENERATE, **inputs, **options})
            chars = input_chars(req)
            check_input_chars(req, chars, 0, self.max_model_len, tokenizer.max_chars_per_token)
            ids = await asyncio.to_thread(encode_input, tokenizer, req, not add_special_tokens, True)
        except wire.ProtocolError as exc:
            raise from_final_error(str(exc)) from None
        if chars >= LARGE_INPUT_CHARS:
            release_freed_memory()
        return ids

    async def decode(self, ids: list[int]) -> str:
        tokenizer = await self.tokenizer()
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
        return tokenizer.decode(ids, skip_special_tokens=False)
