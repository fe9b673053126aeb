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
"""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.frontend.inputs import encode_input
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.http.errors import ApiError, from_final_error
from conveyor.protocol import wire
from conveyor.protocol import requests as client_requests


class Tokens:
    """The tokenizer of ``model_dir``, loaded once when first asked for (None: no model
    directory known, every use is a 503)."""

    def __init__(self, model_dir: str | None) -> None:
        self.model_dir = model_dir
        self._loading: asyncio.Future[Tokenizer] | None = None

    async def tokenizer(self) -> Tokenizer:
        if self.model_dir is None:
            raise ApiError(503, "this HTTP process was started without the model directory: no tokenizer", code="no_tokenizer")
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_dir, self.model_dir))
        return await asyncio.shield(self._loading)

    async def prompt_ids(self, inputs: dict[str, Any], options: dict[str, Any]) -> list[int]:
        """The token ids the frontend makes of one generate input with these option fields;
        the frontend's refusal of a bad field or input as the same 400."""
        tokenizer = await self.tokenizer()
        try:
            req = client_requests.parse_client_message({"type": wire.GENERATE, **inputs, **options})
            return await asyncio.to_thread(encode_input, tokenizer, req, False, True)
        except wire.ProtocolError as exc:
            raise from_final_error(str(exc)) from None

    async def decode(self, ids: list[int]) -> str:
        tokenizer = await self.tokenizer()
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
        return tokenizer.decode(ids, skip_special_tokens=False)
