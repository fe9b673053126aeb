"""Stop strings over a text stream whose deltas can split a stop string anywhere.

A stream must never show text that the final output lacks, so any tail of the text so far
that could still grow into a stop string is held back until the next delta decides it.
With several stop strings the earliest match in the text wins, even when a longer stop
string that starts earlier is completed only after a shorter one has matched: a match is
final only once no stop string can still match at an earlier position.

Invariants:
- The held-back tail is a proper prefix of some stop string, so it is shorter than the
  longest one, and the cost of a ``feed`` depends on ``delta`` and the stop strings only,
  never on the length of the text so far.
- Concatenating everything returned (by ``feed`` and ``flush``) gives the full text cut
  at the earliest match of any stop string (the match itself excluded, or included when
  ``include_stop`` is set: a request's ``include_stop_str_in_output``), or the full text.
- With ``min_tokens`` (a request's ``min_tokens``), the first ``min_tokens`` feeds (one per
  output token) pass through unmatched and unheld: only text from the feed after them is
  searched, so no stop string ends a request before its ``min_tokens`` tokens, as the worker
  masks EOS and ``stop_token_ids`` until then (vLLM skips its stop-string check likewise; a
  match may not start in the text of those first tokens here).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Cuts one request's text at its first stop string; empty strings in ``stop`` are ignored."""

    def __init__(self, stop: Iterable[str], include_stop: bool = False, min_tokens: int = 0) -> None:
        self._stop = [s for s in dict.fromkeys(stop) if s]
        self._include = include_stop
        self._unsearched = min_tokens  # feeds still to pass through before matching starts
        self._held = ""
        self._stopped = False
        # Every match and every held-back tail starts with the first character of a stop string:
        # text holding none of these needs no scan (the common case, checked in C).
        self._firsts = frozenset(s[0] for s in self._stop)

    @classmethod
    def for_request(cls, req) -> StopStringMatcher:
        """A matcher for one output sequence of a parsed generate request (``stop``,
        ``include_stop_str_in_output``, ``sampling.min_tokens``): each of an ``n`` > 1
        request's sequences gets its own."""
        return cls(req.stop, req.include_stop_str_in_output, req.sampling.min_tokens)

    @property
    def active(self) -> bool:
        """True when there is any stop string to look for."""
        return bool(self._stop)

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; everything after it is dropped."""
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return the text that is now safe to show, and whether a stop string matched."""
        if self._stopped:
            return "", True
        if not self._stop:
            return delta, False
        if self._unsearched > 0:
            self._unsearched -= 1
            return delta, False
        text = self._held + delta if self._held else delta
        if self._firsts.isdisjoint(text):  # no match and nothing to hold back
            self._held = ""
            return text, False
        match, end = self._earliest_match(text)
        candidate = self._earliest_candidate(text)
        if match is not None and match <= candidate:
            self._held = ""
            self._stopped = True
            return text[:end], True
        self._held = text[candidate:]
        return text[:candidate], False

    def flush(self) -> str:
        """At the end of the stream: release the held-back text (cut at a match that was waiting)."""
        if self._stopped:
            return ""
        text, self._held = self._held, ""
        match, end = self._earliest_match(text)
        if match is not None:
            self._stopped = True
            return text[:end]
        return text

    def _earliest_match(self, text: str) -> tuple[int | None, int]:
        """Where the earliest match starts (None: no match) and where the text it leaves ends
        (the match's start, or its end with ``include_stop``; the longest stop string wins a tie)."""
        best, end = None, 0
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best or (i == best and i + len(s) > end)):
                best, end = i, i + len(s)
        if best is None or not self._include:
            return best, best or 0
        return best, end

    def _earliest_candidate(self, text: str) -> int:
        """Start of the longest tail of ``text`` that is a proper prefix of a stop string (``len(text)`` if none)."""
        n = len(text)
        best = n
        for s in self._stop:
            first = s[0]
            i = text.find(first, max(0, n - len(s) + 1))  # a proper prefix of s is shorter than s
            while 0 <= i < best:
                if s.startswith(text[i:]):
                    best = i
                    break
                i = text.find(first, i + 1)
        return best
