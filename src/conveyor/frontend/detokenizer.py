"""Streamed detokenization: the text of each new token, emitted as soon as it is final.

How and why: docs/architecture.md, "Incremental detokenization"."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.frontend.tokenizer import Tokenizer

# Prompt tokens kept as initial context (more when these are not visible or start mid-character).
PROMPT_CONTEXT_TOKENS = 5
# How far back an incomplete character at the end of the prompt is looked for. A character has
# at most 4 bytes, but byte-level BPE tokens can straddle characters (last byte of one, first of
# the next), so a run of such tokens can leave every boundary inside a character.
MAX_PROMPT_TAIL_TOKENS = 16
REPLACEMENT_CHAR = "\ufffd"
_UNKNOWN = object()  # a token not in the piece memo yet
_NO_PIECES: dict = {}  # stands for the piece memo of a tokenizer that has none (the fast path is never taken)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        fast_paths: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._vocab_size = tokenizer.vocab_size
        self._byte_pieces = tokenizer.byte_pieces
        self._skipped = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        prompt = list(prompt_token_ids)
        end = len(prompt)
        start = self._context_start(prompt, end)
        text = self._decode(prompt[start:end])
        if text.endswith(REPLACEMENT_CHAR):  # the prompt ends inside a character: leave it to the output
            for cut in range(end - 1, max(0, end - MAX_PROMPT_TAIL_TOKENS) - 1, -1):
                cut_start = self._context_start(prompt, cut)
                cut_text = self._decode(prompt[cut_start:cut])
                if not cut_text.endswith(REPLACEMENT_CHAR):
                    start, end, text = cut_start, cut, cut_text
                    break
        self._ids = prompt[start:]
        self._read = end - start
        self._prefix_text = text
        last_visible = next((t for t in reversed(self._ids) if self._visible(t)), None)
        self._in_byte_run = last_visible in self._byte_pieces
        self._parts: list[str] = []
        # Fast paths (docs/architecture.md, "Incremental detokenization"): tokens whose text does not depend on what
        # precedes them come from a memo, and byte-level tokenizers decode held-back bytes
        # themselves; both only once the context is clean.
        self._pieces = (
            tokenizer.stream_pieces(skip_special_tokens) if fast_paths and tokenizer.streams_by_piece else _NO_PIECES
        )
        self._bytes = tokenizer.stream_bytes(skip_special_tokens) if fast_paths and tokenizer.streams_by_bytes else None
        self._pending: bytes | None = None  # byte mode: the bytes not emitted yet; None: window mode
        self._clean = False
        self._check_clean()

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text that became final with them (possibly "")."""
        if len(new_token_ids) == 1:
            return self.push_one(new_token_ids[0])
        return "".join([self.push_one(token_id) for token_id in new_token_ids])

    def push_one(self, token_id: int) -> str:
        """``push([token_id])``: one token, the streaming hot path."""
        if self._clean:  # nothing held back: a token with a piece adds just that
            entry = self._pieces.get(token_id, _UNKNOWN)
            if entry is _UNKNOWN:
                entry = self._tokenizer.stream_piece(token_id, self._skip_special_tokens)
            if entry is not None:
                piece = entry[0]
                if self._pending is None:  # window mode: the token alone becomes the context
                    self._ids = [token_id]
                    self._read = 1
                    self._prefix_text = alone = entry[1]
                    self._in_byte_run = False
                    self._clean = alone != "" and alone[-1] != REPLACEMENT_CHAR
                self._parts.append(piece)
                return piece
        if self._pending is not None:
            return self._push_bytes(token_id)
        return self._push_window(token_id)

    def _push_bytes(self, token_id: int) -> str:
        """Byte mode: hold the token's bytes back until they end at a character."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._tokenizer.stream_token_bytes(token_id, self._skip_special_tokens)
        pending = self._pending + data
        if not pending:  # an invisible token: nothing changes
            return ""
        text = pending.decode("utf-8", "replace")  # exactly the backend's lossy UTF-8 decode
        if text[-1] == REPLACEMENT_CHAR:  # an incomplete character (or a real U+FFFD: held one token, as before)
            self._pending = pending
            self._clean = False
            return ""
        self._pending = b""
        self._clean = True
        self._parts.append(text)
        return text

    def _push_window(self, token_id: int) -> str:
        """Window mode: decode the context and the tokens not emitted yet."""
        self._ids.append(token_id)
        if self._visible(token_id):
            self._in_byte_run = token_id in self._byte_pieces
        delta = ""
        if not self._in_byte_run:
            text = self._decode(self._ids)
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                delta = self._record(self._emit(text))
        self._check_clean()
        return delta

    def _check_clean(self) -> None:
        """Window mode: whether the context is clean, i.e. everything is emitted and the context
        ends at a character, outside a byte run, with text. A byte-level tokenizer then
        switches to byte mode for good (there a context without text is clean too)."""
        if self._read != len(self._ids) or self._prefix_text.endswith(REPLACEMENT_CHAR):
            self._clean = False
        elif self._bytes is not None:
            self._pending = b""
            self._clean = True
        else:
            self._clean = self._pieces is not _NO_PIECES and not self._in_byte_run and self._prefix_text != ""

    def flush(self) -> str:
        """At end of stream: return the held-back text, incomplete characters as U+FFFD like the full decode."""
        if self._pending is not None:
            pending, self._pending = self._pending, b""
            self._clean = True
            return self._record(pending.decode("utf-8", "replace"))
        if self._read == len(self._ids):
            return ""
        self._in_byte_run = False
        return self._record(self._emit(self._decode(self._ids)))

    def _emit(self, text: str) -> str:
        """Return what ``text`` (the window's decode) adds to the context, and make the new tokens the context."""
        delta = text[len(self._prefix_text) :]
        new = self._ids[self._read :]
        if len(new) == 1 and self._visible(new[0]):  # the common case: one token, its text memoized
            self._ids = new
            self._prefix_text = self._tokenizer.decode_one(new[0], self._skip_special_tokens)
        elif any(self._visible(t) for t in new):
            self._ids = new
            self._prefix_text = self._decode(new)
        else:  # nothing visible among them: keep the old context in front
            self._prefix_text = text
        self._read = len(self._ids)
        return delta

    def _record(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

    def _context_start(self, prompt: list[int], end: int) -> int:
        """Start of the context for ``prompt[:end]``: a few tokens back, holding a visible token, at a character start.

        Only byte-fallback pieces need the boundary (an invalid run decodes as U+FFFDs as a
        whole); byte-level decoding recovers after stray continuation bytes by itself.
        """
        start = max(0, end - PROMPT_CONTEXT_TOKENS)
        has_visible = any(self._visible(t) for t in prompt[start:end])
        while start > 0 and (not has_visible or self._continues_character(prompt[start])):
            start -= 1
            has_visible = has_visible or self._visible(prompt[start])
        return start

    def _continues_character(self, token_id: int) -> bool:
        return 0x80 <= self._byte_pieces.get(token_id, 0) < 0xC0  # a UTF-8 continuation byte

    def _visible(self, token_id: int) -> bool:
        # the decoder drops ids it does not know (models may pad their vocabulary) and skipped ones
        return 0 <= token_id < self._vocab_size and token_id not in self._skipped

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
