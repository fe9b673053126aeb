"""The frontend's tokenizer: HF ``tokenizer.json`` plus ``tokenizer_config.json``, without transformers.

transformers' tokenizer classes import torch whenever torch is installed, and the frontend
process must never import torch (it would cost seconds of startup and hundreds of MB in a
process that only handles text). So this module rebuilds the part of transformers 5 that
serving needs on top of the ``tokenizers`` library and jinja2, and matches it exactly:

- ``encode`` is the backend pipeline of ``tokenizer.json``. transformers 5 drops
  ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json`` whenever a
  ``tokenizer.json`` exists, so BOS/EOS come from its post-processor alone (none if it has
  none); truncation and padding saved in the file are turned off as transformers does.
- Model-specific transformers classes may rebuild part of that pipeline instead of using
  it as saved. ``LlamaTokenizer`` (Llama 2, Mistral) does, and differs from the older
  sentencepiece-style files (no ``▁`` is prepended after a special token or to text that
  starts with a space), so its rebuild is mirrored (in :mod:`conveyor.frontend.tokenizer_files`,
  with the rest of reading a checkpoint's tokenizer files); ``Qwen2Tokenizer``'s equals the
  published files. Other classes are used as ``tokenizer.json`` says.
- Special tokens named in the config but missing from ``tokenizer.json`` are added as
  transformers adds them (``added_tokens_decoder`` entries first, then the named ones).
- Chat templates render in the sandbox of :mod:`conveyor.frontend.chat_template`, with the
  named special tokens as variables, and the rendered text is encoded without adding
  special tokens (a template that wants BOS writes it).
- ``decode`` is the backend decoder. transformers 5 never applies
  ``clean_up_tokenization_spaces`` to BPE models (the Llama family), so neither do we.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from conveyor.frontend import chat_template
from conveyor.frontend.template_literals import literal_spans
from conveyor.frontend.tokenizer_files import (
    add_missing_tokens,
    chat_templates,
    read_json,
    rebuild_like_llama_tokenizer,
    token_content,
    tokenizer_file,
)

# Named special tokens, in transformers' order; each is also a chat-template variable.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# sentencepiece-style byte-fallback pieces: one raw UTF-8 byte each.
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
REPLACEMENT_CHAR = "\ufffd"
# Entries each streaming memo keeps (decode_one, stream_piece, stream_token_bytes; one memo per
# skip_special_tokens value). Bounded by the vocabulary alone, the piece and decode_one memos
# grew to ~44 MB together for a 151k vocabulary once every token had been seen (~270 bytes a
# token in all); 32768 entries (~9 MB for both) hold the tokens of ordinary text. Past the cap a
# memo drops its older half (_memoize); a miss recomputes (three decodes: ~6 us).
STREAM_MEMO_MAX = 32768
_MISSING = object()


def _memoize(memo: dict, key, value, max_entries: int) -> None:
    """``memo[key] = value``; past ``max_entries`` the older half of the entries (by insertion)
    is dropped, in place (~1 ms for 32768, once per 16384 misses). The memo stays the same dict,
    so a reference handed out (``stream_pieces``) stays valid, and a hit stays one lookup."""
    memo[key] = value
    if len(memo) > max_entries:
        for old in list(itertools.islice(memo, len(memo) // 2)):
            del memo[old]


def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``, as tokenizers' ByteLevel
    uses it): printable bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()
# The decoders after which a token adds the same text whatever precedes it (Tokenizer.stream_piece),
# as tokenizer.json spells them: byte-level BPE (GPT-2, Llama 3, Qwen) and the sentencepiece
# chain of Llama 2 / Mistral files and of transformers' LlamaTokenizer (see _piece_decoder).
_SPM_CHAIN = [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SPM_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


class Tokenizer:
    """Text <-> token ids for one checkpoint, and its chat template.

    Invariants: ``encode``/``apply_chat_template``/``decode`` equal transformers 5's
    ``AutoTokenizer`` on the same directory (for the tokenizer classes the module docstring
    names); every id this returns is below ``vocab_size``. Nothing mutates the backend after
    loading, so any method may be called from several threads at once (the frontend encodes
    long prompts in a thread pool while its event loop decodes). The streaming memos
    (``decode_one``, ``stream_piece``, ``stream_token_bytes``) hold entries that are each a
    pure function of their key, at most ``memo_max`` per memo (:data:`STREAM_MEMO_MAX`; the
    older half is dropped past it); a memo is read with one lookup (never a test, then a
    read), so a concurrent fill or drop is harmless too: a token dropped meanwhile is computed
    again.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        source: str = "<memory>",
        memo_max: int = STREAM_MEMO_MAX,
    ) -> None:
        if memo_max < 1:
            raise ValueError(f"memo_max must be at least 1, got {memo_max}")
        self._backend = backend
        self._memo_max = memo_max
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates or {})
        self._source = source
        names = [*self._special_tokens.values(), *extra_special_tokens]
        ids = (backend.token_to_id(t) for t in dict.fromkeys(names))
        self._all_special_ids = [i for i in ids if i is not None]
        self._skipped_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # Control-token texts, longest first, and a copy of the backend that encodes them as text
        # (made on first need): conveyor.frontend.template_literals.
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content}
        self._special_texts = tuple(sorted(specials, key=len, reverse=True))
        self._literal_backend: BackendTokenizer | None = None
        model = backend.model
        byte_fallback = isinstance(model, models.BPE) and model.byte_fallback
        vocab = backend.get_vocab(with_added_tokens=False) if byte_fallback else {}
        pieces = {i: int(t[3:5], 16) for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t)}
        self._byte_pieces = MappingProxyType(pieces)
        # The streaming memos, one per skip_special_tokens value, at most memo_max entries each.
        self._decoded_one: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self._pieces: dict[bool, dict[int, tuple[str, str] | None]] = {True: {}, False: {}}
        self._piece_decoder = _piece_decoder(backend)
        self._anchors: list[tuple[int, str]] | None = None  # stream_piece's plain context tokens, found on first use
        self._token_bytes: dict[bool, dict[int, bytes]] = {True: {}, False: {}}  # byte-level decoders only
        self._bytes_ok = self._piece_decoder == "byte_level" and self._check_token_bytes()
        self._max_chars_per_token = 1 + max(map(len, backend.get_vocab(with_added_tokens=True)), default=0)

    @classmethod
    def from_dir(cls, path: str | Path, *, memo_max: int = STREAM_MEMO_MAX) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json`` and chat template files from ``path``."""
        root = Path(path).expanduser()
        tok_file = tokenizer_file(root)
        try:
            backend = BackendTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"cannot load {tok_file}: {exc}") from None
        config = read_json(root / "tokenizer_config.json") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{root / 'tokenizer_config.json'}: expected a JSON object")

        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if config.get("tokenizer_class") in ("LlamaTokenizer", "LlamaTokenizerFast"):
            rebuild_like_llama_tokenizer(backend, config)

        special = {name: token_content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # v5 may name them: {"image_token": "<image>", ...}
            extra = list(extra.values())
        extra = [token_content(t) for t in extra]
        add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, [*special.values(), *extra])
        return cls(backend, special, extra, chat_templates(root, config), source=str(root), memo_max=memo_max)

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens, added tokens included (``len(tokenizer)`` in transformers)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_chars_per_token(self) -> int:
        """At most how many characters of text one token stands for: the longest vocabulary
        string, plus one. A vocabulary string has at least as many characters as the text its
        token covers (byte-level BPE: one character per byte, and a text has no more characters
        than bytes; sentencepiece: ``▁`` is one space, a ``<0xNN>`` piece one byte; WordPiece:
        ``##`` is dropped), and the one added covers a space a decoder puts between tokens. So a
        text longer than ``n * max_chars_per_token`` characters has more than ``n`` tokens and
        can be refused without tokenizing it (:func:`conveyor.frontend.inputs.check_input_chars`).
        (A normalizer that drops characters, e.g. whitespace, could make it fewer; no
        tokenizer served here does, and the bound errs on that side only for such text.)"""
        return self._max_chars_per_token

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens, then the extra ones, without duplicates."""
        return list(self._all_special_ids)

    @property
    def skipped_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops: the added tokens flagged special."""
        return self._skipped_ids

    @property
    def byte_pieces(self) -> Mapping[int, int]:
        """Id -> byte value of the ``<0xNN>`` pieces, when the model falls back to bytes (empty otherwise).

        The decoder turns a run of them into text all at once, and an invalid run into one
        U+FFFD per byte, so a run's text is not final until a non-byte token ends it.
        """
        return self._byte_pieces

    def _special_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Vocabulary strings of ``ids`` (byte-level or sentencepiece pieces); None for unknown ids."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    # ------------------------------------------------------------------ text

    def encode(self, text: str, add_special_tokens: bool = True, *, release_gil: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) are added as tokenizer.json's post-processor says.

        ``release_gil``: the same ids, but other Python threads run while the Rust side
        works. ``tokenizers``' ``encode`` holds the GIL for the whole call (measured: a
        200k-character prompt held it ~0.2 s) while ``encode_batch`` releases it, so this
        goes through a batch of one. For a thread pool off the event loop; it costs a few
        tens of microseconds more per call, so short inputs are better encoded plainly.
        """
        if release_gil:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary are dropped (as the backend does)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id], skip_special_tokens)``, memoized: streaming decodes it once per token."""
        memo = self._decoded_one[skip_special_tokens]
        text = memo.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens)
            if 0 <= token_id < self.vocab_size:
                _memoize(memo, token_id, text, self._memo_max)
        return text

    @property
    def streams_by_piece(self) -> bool:
        """True when :meth:`stream_piece` can name any token's text: the decoder is one whose
        output is the concatenation of per-token pieces (see :func:`_piece_decoder`)."""
        return self._piece_decoder is not None

    def stream_piece(self, token_id: int, skip_special_tokens: bool = True) -> tuple[str, str] | None:
        """``(piece, alone)`` for a token whose text does not depend on what comes before it,
        or None. Memoized; :meth:`stream_pieces` hands out the memo for lookups in hot loops.

        ``piece`` is what the token adds to ``decode(context)``: ``decode(context + [token_id])
        == decode(context) + piece`` for every context whose decode is not empty and does not
        end in U+FFFD and whose last visible token is not a byte-fallback piece. ``alone`` is
        ``decode([token_id])`` (sentencepiece decoders drop the leading space of the first
        token, so it can differ from ``piece``). None for the tokens where no such piece exists
        or it is not worth the trouble: ids outside the vocabulary, skipped special tokens,
        byte-fallback pieces, tokens whose text is empty or holds U+FFFD (an incomplete
        character), and every token when the decoder is not one :func:`_piece_decoder` knows.
        """
        memo = self._pieces[skip_special_tokens]
        value = memo.get(token_id, _MISSING)
        if value is _MISSING:
            value = self._find_piece(token_id, skip_special_tokens)
            if 0 <= token_id < self.vocab_size:  # ids outside it would be no use to remember
                _memoize(memo, token_id, value, self._memo_max)
        return value

    def stream_pieces(self, skip_special_tokens: bool = True) -> Mapping[int, tuple[str, str] | None]:
        """The memo of :meth:`stream_piece` (a token missing from it: ask :meth:`stream_piece`,
        which puts it back). The same object for the tokenizer's life."""
        return self._pieces[skip_special_tokens]

    @property
    def streams_by_bytes(self) -> bool:
        """True when the decoder is byte-level: the text of any ids is the lossy UTF-8 decode of
        the concatenation of their :meth:`stream_token_bytes` (checked on loading)."""
        return self._bytes_ok

    def stream_token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes a byte-level decoder turns ``token_id`` into (empty for ids it drops:
        outside the vocabulary, or skipped). Memoized; :meth:`stream_bytes` hands out the memo."""
        memo = self._token_bytes[skip_special_tokens]
        data = memo.get(token_id)
        if data is None:
            data = self._find_token_bytes(token_id, skip_special_tokens)
            if 0 <= token_id < self.vocab_size:
                _memoize(memo, token_id, data, self._memo_max)
        return data

    def stream_bytes(self, skip_special_tokens: bool = True) -> Mapping[int, bytes]:
        """The memo of :meth:`stream_token_bytes` (a token missing from it: ask :meth:`stream_token_bytes`)."""
        return self._token_bytes[skip_special_tokens]

    def _find_token_bytes(self, token_id: int, skip: bool) -> bytes:
        if not 0 <= token_id < self.vocab_size or (skip and token_id in self._skipped_ids):
            return b""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        try:  # as tokenizers' ByteLevel decoder: each character is one byte, else the token is its own UTF-8
            return bytes([_BYTE_LEVEL_CHARS[c] for c in token])
        except KeyError:
            return token.encode("utf-8")

    def _check_token_bytes(self) -> bool:
        """Whether :meth:`stream_token_bytes` agrees with the backend's decode, on every added
        token and on a spread of ordinary ones (the check costs a few milliseconds)."""
        size = self.vocab_size
        ids = {*self._backend.get_added_tokens_decoder(), *range(0, size, max(1, size // 512))}
        for skip in (False, True):
            for i in ids:
                if self._find_token_bytes(i, skip).decode("utf-8", "replace") != self.decode([i], skip):
                    return False
        return True

    def _find_piece(self, token_id: int, skip: bool) -> tuple[str, str] | None:
        if self._piece_decoder is None or not 0 <= token_id < self.vocab_size or token_id in self._byte_pieces:
            return None
        if skip and token_id in self._skipped_ids:
            return None
        anchors = self._piece_anchors()
        if not anchors:
            return None
        piece = None
        for anchor, anchor_text in anchors:  # after two different plain tokens it must add the same text
            both = self.decode([anchor, token_id], skip)
            if not both.startswith(anchor_text):
                return None
            added = both[len(anchor_text) :]
            if piece is not None and added != piece:
                return None
            piece = added
        if not piece or REPLACEMENT_CHAR in piece:
            return None
        alone = self.decode_one(token_id, skip)
        return (alone if alone == piece else piece), alone

    def _piece_anchors(self) -> list[tuple[int, str]]:
        """Two ordinary tokens (one ASCII character or word each, no byte pieces, no specials) to
        measure a piece after; empty when the vocabulary has none (no token is then streamed by piece)."""
        if self._anchors is None:
            found: dict[int, str] = {}
            for word in ("a", "b", "e", "t", "x", "the", "1", "2", "."):
                ids = self._backend.encode(word, add_special_tokens=False).ids
                if len(ids) != 1 or ids[0] in self._byte_pieces or ids[0] in self._skipped_ids or ids[0] in found:
                    continue
                text = self.decode(ids)
                if text and text == self.decode(ids, skip_special_tokens=False) and text.isascii():
                    found[ids[0]] = text
                if len(found) == 2:
                    break
            self._anchors = list(found.items()) if len(found) == 2 else []
        return self._anchors

    # ------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> str | None:
        """The template ``render_chat`` uses: the only one, or the one named ``default``."""
        return self._chat_templates.get("default")

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, as transformers' ``apply_chat_template(...,
        tokenize=False)``: ``variables`` are extra template variables (a request's
        ``chat_template_kwargs``; they win over the special tokens' names, as there), and
        ``continue_final_message`` cuts the text right after the last message's content, so
        the model continues that message instead of starting a new one (ValueError when the
        template does not write that content as it is)."""
        template = self.chat_template
        if template is None:
            if self._chat_templates:
                raise ValueError(
                    f"the tokenizer in {self._source} has several chat templates "
                    f"({', '.join(sorted(self._chat_templates))}) and none is named 'default'"
                )
            raise ValueError(
                f"the tokenizer in {self._source} has no chat template (no chat_template in tokenizer_config.json, "
                "no chat_template.jinja): send a text prompt or token ids instead of messages"
            )
        names = {**self._special_tokens, **variables} if variables else self._special_tokens
        text = chat_template.render(template, messages, add_generation_prompt, names)
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise ValueError(
                    "continue_final_message: the chat template does not write the final message's content as it is"
                )
            text = text[: end + len(final)]
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        release_gil: bool = False,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`'s text; no special tokens beyond those the template
        writes: special-token text inside the messages is encoded as text
        (:mod:`conveyor.frontend.template_literals`; ValueError where the template changes such a message).

        ``release_gil`` as in :meth:`encode` (the template itself renders in Python, holding it).
        """
        text = self.render_chat(
            messages, add_generation_prompt, continue_final_message=continue_final_message, variables=variables
        )
        spans = literal_spans(text, messages, self._special_texts)
        if not spans:
            return self.encode(text, add_special_tokens=False, release_gil=release_gil)
        if self._literal_backend is None:  # (two threads may both make one: either serves)
            literal = BackendTokenizer.from_str(self._backend.to_str())
            literal.encode_special_tokens = True
            self._literal_backend = literal
        ids: list[int] = []
        pos = 0
        for start, end in spans:  # the template's text as before, special-token text in messages as text
            if start > pos:
                ids += self.encode(text[pos:start], add_special_tokens=False, release_gil=release_gil)
            ids += self._literal_backend.encode(text[start:end], add_special_tokens=False).ids
            pos = end
        if pos < len(text):
            ids += self.encode(text[pos:], add_special_tokens=False, release_gil=release_gil)
        return ids


# ---------------------------------------------------------------------- streaming helpers


def _piece_decoder(backend: BackendTokenizer) -> str | None:
    """Which known piecewise decoder ``backend`` has, or None.

    - ``ByteLevel``: each token maps to its own bytes, and the text is the UTF-8 decode (lossy)
      of their concatenation. After bytes that end at a character (a decode that does not
      end in U+FFFD), a token whose bytes are valid UTF-8 by themselves adds exactly its own
      text.
    - ``Replace("▁", " "), ByteFallback, Fuse`` and optionally ``Strip(" ", 1, 0)``: the text
      is the concatenation of each token with ``▁`` as a space (a run of byte pieces
      becomes its UTF-8 text), then one leading space is cut from the whole. After a context
      whose text is not empty (so the cut falls inside it) and that does not end in a byte
      run, a non-byte token adds exactly its own text, leading space included.

    Anything else (WordPiece's joining and clean-up, Metaspace's per-token rules, custom
    chains) is not piecewise, or not known to be: every token then goes through the window
    decode of :class:`conveyor.frontend.detokenizer.IncrementalDetokenizer`.
    """
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except ValueError:  # pragma: no cover - the backend always serializes
        return None
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "ByteLevel":
        return "byte_level"
    if decoder.get("type") == "Sequence":
        steps = decoder.get("decoders")
        if steps == _SPM_CHAIN or steps == [*_SPM_CHAIN, _SPM_STRIP]:
            return "sentencepiece"
    return None
