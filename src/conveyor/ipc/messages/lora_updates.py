"""Loading and unloading LoRA adapters on a running server (tags 60-69).

A client's ``load_lora`` travels frontend -> every live replica's scheduler -> its worker
ranks as :class:`LoadLora`, on the plan channel; each rank starts reading the files on a
thread and goes on with its steps. Rank 0 says when its read is over (:class:`LoraRead`);
the scheduler then sends :class:`CommitLora` on the plan channel, and every rank, reading it
between the same two plans, registers the adapter (or agrees with the others that it
cannot); rank 0 answers :class:`LoraUpdated`. The scheduler accepts requests naming the
adapter only once that answer is a success, and forwards it to the frontend, which answers
the client once every replica has (conveyor.worker.lora_updates says why in two phases).
``unload_lora`` is decided by the scheduler (refused while a live request names the
adapter): it answers the frontend at once and forwards the :class:`UnloadLora` to the
worker, which frees the adapter's slot and host copy between steps (no plan sent after the
answer names it, and the plans sent before run first).
"""

from __future__ import annotations

from conveyor.ipc.messages.tagged import Message, message

# LoraUpdated.code: what became of the update (the client protocol's error codes, or "ok").
LORA_OK = "ok"
LORA_ALREADY_LOADED = "lora_already_loaded"  # load: the name is taken (or being loaded)
LORA_NOT_FOUND = "lora_not_found"  # unload: no such adapter; load: its directory or files are missing
LORA_INVALID = "invalid_lora"  # load: the adapter does not fit (rank, targets, shapes, format)
LORA_IN_USE = "lora_in_use"  # unload: live requests name it


@message
class LoadLora(Message, tag=60):
    """Register the PEFT adapter in ``path`` (a directory on the worker's host) as ``name``."""

    query_id: str
    name: str
    path: str


@message
class UnloadLora(Message, tag=61):
    """Forget the adapter ``name``."""

    query_id: str
    name: str


@message
class LoraRead(Message, tag=63):
    """Worker rank 0 to the scheduler: its read of load ``query_id`` is over (read or refused)."""

    query_id: str


@message
class CommitLora(Message, tag=64):
    """Scheduler to every worker rank: register load ``query_id``'s adapter now (or agree it fails)."""

    query_id: str


@message
class LoraUpdated(Message, tag=62):
    """The answer to a :class:`LoadLora` or :class:`UnloadLora` of ``query_id``: ``code``
    :data:`LORA_OK`, or one of the error codes above with ``error`` saying why."""

    query_id: str
    name: str
    code: str = LORA_OK
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.code == LORA_OK
