"""What the HTTP process needs of the model's tokenizer, asked of the frontend: ``/tokenize``
and ``/detokenize``, ``echo``, ``return_token_ids``, prompt log-probabilities and the prompt
count of ``stream_options.continuous_usage_stats`` travel as the client protocol's
``tokenize`` / ``detokenize`` messages (docs/protocol.md), so this process never tokenizes:
the frontend bounds the input before tokenizing it, off its event loop when large, with the
generate request's own refusals (the same 400s). Only ``/tokenizer_info`` reads the
tokenizer's files here (loaded on first use, on a thread; nothing is encoded with it).
The think block's tag ids (:meth:`Tokens.think_ids`, for the usage's ``reasoning_tokens``)
are asked of the frontend once.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from conveyor.client import ServerError
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.http.errors import ApiError, from_final_error
from conveyor.protocol import wire
from conveyor.protocol.token_commands import TOKENIZE_INPUT
from conveyor.structured.reasoning import CLOSE, OPEN

if TYPE_CHECKING:
    from conveyor.http.link import FrontendLink


class Tokens:
    """Tokenizing through ``link`` (the frontend); ``model_dir``'s tokenizer files for
    ``/tokenizer_info`` (None: no model directory known, that route is a 503)."""

    def __init__(self, model_dir: str | None, max_model_len: int, link: FrontendLink | None = None) -> None:
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.link = link
        self._loading: asyncio.Future[Tokenizer] | None = None
        self._think_ids: tuple[int, int] | None = None

    async def tokenizer(self) -> Tokenizer:
        """The tokenizer's configuration (``/tokenizer_info``): loaded here, never used to encode."""
        if self.model_dir is None:
            raise ApiError(
                503, "this HTTP process was started without the model directory: no tokenizer", code="no_tokenizer"
            )
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_dir, self.model_dir))
        return await asyncio.shield(self._loading)

    async def tokenize(
        self, inputs: dict[str, Any], options: dict[str, Any], add_special_tokens: bool = True, token_strs: bool = False
    ) -> dict[str, Any]:
        """The frontend's ``tokens`` reply for one generate input with these option fields
        (those that shape the input; ``add_special_tokens`` False: a text prompt without
        BOS); its refusal (too long for the model included) as the generate's 400."""
        fields = {k: v for k, v in {**inputs, **options}.items() if k in TOKENIZE_INPUT}
        if not add_special_tokens:
            fields["add_special_tokens"] = False
        if token_strs:
            fields["return_token_strs"] = True
        return await self._ask(self._client().tokenize(fields.pop("prompt", None), **fields))

    async def prompt_ids(
        self, inputs: dict[str, Any], options: dict[str, Any], add_special_tokens: bool = True
    ) -> list[int]:
        """The token ids the frontend makes of one generate input (:meth:`tokenize`)."""
        return (await self.tokenize(inputs, options, add_special_tokens))["token_ids"]

    async def think_ids(self) -> tuple[int, int]:
        """The ids of the ``<think>`` and ``</think>`` tokens (asked once). bin/serve refuses
        ``--reasoning-parser`` for a tokenizer without them (:mod:`conveyor.assembly.preflight`);
        a 500 naming them here where that check was not made."""
        if self._think_ids is None:
            ids = [
                (await self._ask(self._client().tokenize(tag, add_special_tokens=False)))["token_ids"]
                for tag in (OPEN, CLOSE)
            ]
            if any(len(tag_ids) != 1 for tag_ids in ids):
                raise ApiError(
                    500,
                    f"--reasoning-parser needs a tokenizer whose {OPEN} and {CLOSE} are single tokens; this one's are "
                    f"{ids[0]} and {ids[1]}",
                    code="no_think_tokens",
                )
            self._think_ids = (ids[0][0], ids[1][0])
        return self._think_ids

    async def decode(self, ids: list[int]) -> str:
        """``ids`` decoded by the frontend as they are (special tokens kept)."""
        try:
            return (await self._ask(self._client().detokenize(ids)))["text"]
        except ApiError as exc:
            if exc.status == 400:
                exc.param = "tokens"
            raise

    def _client(self):
        if self.link is None:
            raise ApiError(503, "this HTTP process has no line to the frontend: no tokenizer", code="no_tokenizer")
        return self.link.client

    async def _ask(self, answer) -> dict[str, Any]:
        from conveyor.http.link import api_error

        try:
            return await answer
        except ServerError as exc:
            if exc.code in (wire.INVALID_FIELD, wire.INVALID_INPUT, wire.PROMPT_TOO_LONG):
                raise from_final_error(str(exc)) from None
            raise api_error(exc) from None
        except Exception as exc:
            raise api_error(exc) from None
