"""The worker's half of structured output: each constrained request's matcher, and the step's
bitmask filled where the sampled tokens are known.

The worker rebuilds the matcher from the grammar the frontend compiled and advances it with
every sampled token, filling the next mask while the forward runs; a request taken in again
replays its outputs into a fresh matcher (docs/architecture.md, "Structured output in the
worker").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.structured.grammar_engine import EngineTokenizer, load_llguidance
from conveyor.structured.matcher import GrammarMatcher, allocate_bitmask, bitmask_width, fill_rows

# Prototype matchers kept by grammar text: a request's matcher is a deep copy (~10 us).
MAX_CACHED_GRAMMARS = 256


@dataclass
class GrammarRow:
    """One request's matcher and how many of its tokens it has consumed (an index into the
    request's known tokens: it starts at the prompt's length)."""

    matcher: GrammarMatcher
    consumed: int


@dataclass
class StepMask:
    """What the sampler needs for one step's constrained rows: the int32 bitmask (one row per
    logits row, untouched rows all ones) and which rows to apply it to."""

    bitmask: torch.Tensor
    rows: list[int]


class GrammarRows:
    """Builds matchers from grammar text and fills a step's bitmask. One per model runner; the
    engine's tokenizer is built on the first constrained request (0.1 s for 4k tokens, ~1.5 s
    for 64k), so servers that never see one pay nothing."""

    def __init__(self, model_dir: str | Path) -> None:
        self._model_dir = model_dir
        self._tokenizer: EngineTokenizer | None = None
        self._prototypes: OrderedDict[str, object] = OrderedDict()
        self._staging = MaskStaging()

    def row(self, grammar: str, num_prompt_tokens: int) -> GrammarRow:
        """A fresh matcher for ``grammar`` (compiled once per text, then copied)."""
        prototype = self._prototypes.get(grammar)
        if prototype is None:
            if self._tokenizer is None:
                self._tokenizer = EngineTokenizer.for_model(self._model_dir)
            prototype = load_llguidance().LLMatcher(self._tokenizer.ll, grammar, log_level=0)
            self._prototypes[grammar] = prototype
            while len(self._prototypes) > MAX_CACHED_GRAMMARS:
                self._prototypes.popitem(last=False)
        else:
            self._prototypes.move_to_end(grammar)
        return GrammarRow(GrammarMatcher(prototype.deep_copy()), num_prompt_tokens)

    def fill(
        self, rows: Sequence[tuple[int, int, GrammarRow, list[int], int | None]], num_rows: int, device: torch.device
    ) -> tuple[StepMask, list[tuple[int, str]]]:
        """Fill the mask of a step's constrained rows. ``rows``: ``(logits row, slot, grammar
        row, the request's token ids, the token the step in flight sampled for it or None)``.
        Returns the mask for ``num_rows`` logits rows and the rows' ends, ``(slot, error)``:
        "" when the grammar is complete, else why the row is a dead end."""
        assert self._tokenizer is not None
        vocab = self._tokenizer.mask_vocab
        host = self._staging.take(num_rows, vocab, device)
        bitmask = host.numpy()
        for _, _, grammar, tokens, pending in rows:
            known = tokens if pending is None else tokens + [pending]
            for token in known[grammar.consumed :]:
                if not grammar.matcher.accept(token):
                    break  # failed for good: reported below as a dead end
            grammar.consumed = len(known)
        dead = set(fill_rows([(g.matcher, row) for row, _, g, _, _ in rows], bitmask))
        ends: list[tuple[int, str]] = []
        for row, slot, grammar, _, _ in rows:
            if row in dead:
                ends.append((slot, grammar.matcher.error or "no token is allowed here"))
            elif grammar.matcher.is_terminated:
                ends.append((slot, ""))
        return StepMask(self._staging.upload(host, device), [r for r, *_ in rows]), ends


class MaskStaging:
    """The host buffers a step's bitmask is filled in and uploaded from, allocated once (grown
    when a step has more rows or the vocabulary is wider, never per step).

    Beside a GPU they are pinned: a ``non_blocking`` copy from pageable memory makes the host
    stage it through a driver buffer before returning (a wait of about 2 MB's copy a step at a
    128K vocabulary and batch 128), while one from pinned memory is only enqueued. An enqueued
    copy reads the buffer when the stream reaches it, after the forward it follows, so a buffer
    is not written again before its last copy is done: two buffers are used in turn, each with
    an event recorded after its copy and waited on before its next fill (two steps later: done
    long since, unless nothing else made the host wait for the device in between). On a CPU
    the "upload" is the buffer itself, used by the sampler before the next fill: one buffer."""

    SLOTS_CUDA = 2

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event] = []  # beside a GPU, one per buffer
        self._in_flight: list[bool] = []  # a copy from the buffer was enqueued since its last wait
        self._turn = 0

    def take(self, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """The next host buffer's first ``num_rows`` rows, free to be written."""
        cuda = device.type == "cuda"
        have = self._buffers[0].shape if self._buffers else (0, 0)
        if (
            have[0] < num_rows
            or have[1] != bitmask_width(vocab)
            or len(self._buffers) != (self.SLOTS_CUDA if cuda else 1)
        ):
            rows = max(num_rows, 2 * have[0])
            self._buffers = [self._allocate(rows, vocab, cuda) for _ in range(self.SLOTS_CUDA if cuda else 1)]
            self._copied = [torch.cuda.Event() for _ in self._buffers] if cuda else []
            self._in_flight = [False] * len(self._buffers)
            self._turn = 0
        turn = self._turn
        self._turn = (turn + 1) % len(self._buffers)
        if self._in_flight[turn]:
            self._copied[turn].synchronize()  # its previous copy has read it (long since, in practice)
            self._in_flight[turn] = False
        return self._buffers[turn][:num_rows]

    @staticmethod
    def _allocate(rows: int, vocab: int, cuda: bool) -> torch.Tensor:
        host = torch.from_numpy(allocate_bitmask(rows, vocab))
        return host.pin_memory() if cuda else host

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (from :meth:`take`) on ``device``: an enqueued copy, its buffer's event recorded after it."""
        if device.type != "cuda":
            return host
        mask = host.to(device, non_blocking=True)
        turn = (self._turn - 1) % len(self._buffers)
        self._copied[turn].record()
        self._in_flight[turn] = True
        return mask
