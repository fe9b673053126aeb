"""Parallel sampling: one request, ``n`` sequences sharing the KV of its prompt.

A request whose ``sampling.n`` is above 1 enters the scheduler as ``n`` *sequences*, each an
ordinary :class:`~conveyor.scheduler.request.SchedulerRequest` named ``{request_id}/{i}``
(:func:`sequence_id`) with its own seed stream (``seed + i`` modulo 2**64: sequence ``i``
draws exactly what a single request with that seed draws; unseeded sequences draw
independently). From then on every rule of the scheduler treats a sequence as a request
(slots, decodes, stops, preemption by swap or recompute, aborts, step failures), so its
invariants hold for sequences as they do for requests. What is particular to a group is how
its sequences start (:class:`SeqGroup`):

- Sequence 0 (the *leader*) is queued at once and prefills the prompt. The others are
  *held*: live, WAITING, holding nothing, and not in the waiting line, until the leader's
  KV of the prompt's first ``P - 1`` tokens is known to be written (``P`` prompt tokens), or
  the leader finished before that. Then they are queued right behind the leader's rank
  (:func:`release_held`, at the start of each plan).
- A held sequence admitted while the leader runs with that KV *forks* from it
  (:meth:`~conveyor.scheduler.kv_manager.KVCacheManager.fork`): it takes a reference to each
  of the leader's full blocks within those ``P - 1`` tokens (reference-counted in the block
  pool, like a prefix-cache hit) and a fresh copy of the block holding the rest (the plan's
  ``copy_blocks``), then runs the prompt's last token itself, which gives it the logits its
  first token is drawn from with its own seed. So ``n`` sequences cost one prefill plus one
  token each, and ``full`` blocks of the prompt are held once, not ``n`` times.
- A held sequence admitted otherwise (the leader finished, was preempted, or was admitted
  again after a preemption of its own) is admitted like any request, prefix cache included.

Aborting the request id aborts every live sequence of it; a sequence id aborts that one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.scheduler.request import RequestStatus, SchedulerRequest

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState


def fork_source(state: SchedulerState, req: SchedulerRequest) -> SchedulerRequest | None:
    """The leader ``req`` forks from if admitted now: a never-admitted non-leader sequence whose
    leader runs with the KV of the prompt's first ``P - 1`` tokens written."""
    group = req.group
    if group is None or req.scheduled_time is not None:
        return None
    leader = group.leader
    return leader if leader is not req and fork_ready(state, leader) else None


def release_held(state: SchedulerState) -> None:
    """Queue the held sequences of every group whose leader has written the prompt's KV
    (they will fork from it) or has finished (they start like any request), right behind
    the leader's rank."""
    keep = []
    for group in state.forking:
        if not group.held:
            continue
        leader = group.leader
        if leader.status is RequestStatus.FINISHED or fork_ready(state, leader):
            for i, seq in enumerate(group.held, start=1):
                seq.rank = leader.rank + (i,)
                state.queue.push(seq)
            group.held = []
        else:
            keep.append(group)
    state.forking = keep


def fork_ready(state: SchedulerState, leader: SchedulerRequest) -> bool:
    """Whether ``leader`` runs with the KV of its prompt's first ``P - 1`` tokens written."""
    return leader.status is RequestStatus.RUNNING and state.done_tokens(leader) >= leader.num_prompt_tokens - 1
