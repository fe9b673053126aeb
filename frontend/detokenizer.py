"""Streamed detokenization: the text of each new token, emitted as soon as it is final.

Decoding one token at a time is wrong: a character can span several tokens (byte-level BPE
pieces of a multi-byte UTF-8 character, sentencepiece byte-fallback pieces like ``<0xE2>``),
and a token's text can depend on its neighbours (sentencepiece decoders drop the leading
space of the first token they see). Decoding the whole output every step is right but
costs O(length) per token. So this keeps a short window of ids:

    ids[:read]   context: already emitted (or prompt), decoded only to measure ``prefix_text``
    ids[read:]   not emitted yet

Each new token decodes the window and emits what it adds to ``prefix_text``, unless that
text may still change: it ends in U+FFFD (an incomplete character), or the last visible
token is a byte-fallback piece (the decoder turns a run of those into text as a whole,
and an invalid run into one U+FFFD per byte). After an emission the emitted tokens become
the context, so the window stays a few tokens long: O(window) work per token.

Invariants:
- The context holds a visible token (one that decodes to something: inside the vocabulary,
  not skipped) unless the prompt has none, so both decodes apply a decoder's first-token
  rule (sentencepiece's leading space) to the same token; with byte-fallback pieces it also
  starts at a character.
- Let P be the longest prefix of the prompt, at most ``MAX_PROMPT_TAIL_TOKENS`` shorter,
  whose decode does not end in U+FFFD (the whole prompt if there is none): a character the
  prompt leaves incomplete is completed by the output and shows there. After
  :meth:`flush`, ``text == decode(prompt + output)[len(decode(P)):]`` with the same
  ``skip_special_tokens``. With byte-level BPE and a prompt that ends at a character that
  is just ``decode(output)``; with sentencepiece the first output token keeps its leading
  space, as in the full text.
- Text once emitted is never revised, so a stream shows no U+FFFD that the final text lacks
  at that place. (No stream can follow one case: output bytes that extend a byte-fallback
  run at the end of the prompt into invalid UTF-8 turn the prompt's own text into U+FFFDs.)
"""

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


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
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

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text that became final with them (possibly "")."""
        out = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            if self._visible(token_id):
                self._in_byte_run = token_id in self._byte_pieces
            if self._in_byte_run:
                continue
            text = self._decode(self._ids)
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                out.append(self._emit(text))
        return self._record("".join(out))

    def flush(self) -> str:
        """At end of stream: return the held-back text, incomplete characters as U+FFFD like the full decode."""
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
