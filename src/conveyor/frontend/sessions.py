"""Finished requests remembered for continuation: a client that sends a ``generate`` under the
id of a finished request continues it (docs/protocol.md).

Each entry is a context, the token ids of a finished turn (its prompt, earlier turns
included, then the tokens returned to the client), under the client's request id. A new
request under that id takes the context (:meth:`Sessions.take`) and appends its own input;
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

from conveyor.ipc.messages import FinishReason


class Sessions:
    """Bounded LRU of contexts by client request id, least recently finished first."""

    def __init__(self, max_sessions: int) -> None:
        self._max_sessions = max_sessions
        self._contexts: OrderedDict[str, list[int]] = OrderedDict()

    def context(self, request_id: str) -> list[int] | None:
        """The context a new request under ``request_id`` would continue, or None."""
        return self._contexts.get(request_id)

    def take(self, request_id: str) -> None:
        """A continuation of ``request_id`` was admitted: its context is in use until it finishes."""
        self._contexts.pop(request_id, None)

    def remember(
        self, request_id: str, prompt_ids: list[int], history_len: int, token_ids: list[int], reason: str
    ) -> None:
        """A turn finished for ``reason``: keep its whole context (``prompt_ids`` + ``token_ids``),
        or if it failed, the first ``history_len`` ids of its prompt (the context it continued)."""
        if reason == FinishReason.ERROR:
            context = prompt_ids[:history_len] if history_len else None
        else:
            context = prompt_ids + token_ids
        if not context:
            return
        contexts = self._contexts
        contexts[request_id] = context
        contexts.move_to_end(request_id)
        while len(contexts) > self._max_sessions:
            contexts.popitem(last=False)
