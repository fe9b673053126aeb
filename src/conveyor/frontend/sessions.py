"""Finished requests remembered for continuation: a client that sends a ``generate`` under the
id of a finished request continues it (docs/protocol.md).

Each entry is a context, the token ids of a finished turn (its prompt, earlier turns
included, then the tokens returned to the client), under its key: for the frontend the pair
(client, client's request id), so a client continues only its own requests (a request id
names a request only within its client); the in-process engine keys by request id. A new
request under that key takes the context (:meth:`Sessions.take`) and appends its own input;
when that turn finishes, the longer context comes back (:meth:`Sessions.remember`).

Invariants:
- At most ``max_sessions`` contexts are kept; past that the least recently finished goes.
- A turn that fails (``error``) puts back the context it continued, unchanged, so the
  client can retry it; one that fails on a first turn leaves nothing.
- A continuation whose input is still tokenizing has not taken its context yet: if it is
  aborted then, the earlier context stays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from conveyor.ipc.messages import FinishReason


class Sessions:
    """Bounded LRU of contexts by request key, least recently finished first."""

    def __init__(self, max_sessions: int) -> None:
        self._max_sessions = max_sessions
        self._contexts: OrderedDict[Hashable, list[int]] = OrderedDict()

    def context(self, key: Hashable) -> list[int] | None:
        """The context a new request under ``key`` would continue, or None."""
        return self._contexts.get(key)

    def take(self, key: Hashable) -> None:
        """A continuation of ``key`` was admitted: its context is in use until it finishes."""
        self._contexts.pop(key, None)

    def remember(
        self, key: Hashable, prompt_ids: list[int], history_len: int, token_ids: list[int], reason: str
    ) -> None:
        """A turn finished for ``reason``: keep its whole context (``prompt_ids`` + ``token_ids``),
        or if it failed, the first ``history_len`` ids of its prompt (the context it continued)."""
        if reason == FinishReason.ERROR:
            self.restore(key, prompt_ids, history_len)
        else:
            self._keep(key, prompt_ids + token_ids)

    def restore(self, key: Hashable, prompt_ids: list[int], history_len: int) -> None:
        """Put back the context a turn continued (the first ``history_len`` ids of its
        prompt), unchanged: what a failed turn leaves, and what an ``n`` > 1 turn leaves
        (its choices are several; the client continues one by sending it as input)."""
        if history_len:
            self._keep(key, prompt_ids[:history_len])

    def _keep(self, key: Hashable, context: list[int]) -> None:
        if not context:  # (a turn aborted while its input tokenized: it took nothing)
            return
        contexts = self._contexts
        contexts[key] = context
        contexts.move_to_end(key)
        while len(contexts) > self._max_sessions:
            contexts.popitem(last=False)
