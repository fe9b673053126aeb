"""The supervisor of a server's processes: start them in order, watch them, stop them.

Startup: the worker loads the model and sizes the KV pool while the frontend
loads the tokenizer (and the HTTP process, with ``--http-port`` or ``--metrics-port``,
binds its ports) and the scheduler process imports its modules; the scheduler gets its
config, and starts, once the worker has reported its block count. Each child imports its
own modules (spawned by name: :func:`conveyor.runtime.process.run_entry`), none of which
bin/serve imports. With ``--tensor-parallel-size N`` the worker is N
processes (ranks, each watched like any child); rank 0 reports the KV pool the
ranks agreed on (conveyor.worker.main). With ``--data-parallel-size M`` there are M
such worker + scheduler pairs (replica 0's processes named as a single server's,
replica i's ``worker.i`` and ``scheduler.i``; each its own internal sockets and
rings, :meth:`ServerConfig.replica`) behind the one frontend
(:mod:`conveyor.frontend.replicas`).

Supervision: if any child exits, every in-flight request gets an error (the
frontend is told to fail them before it exits), the other children are
stopped, and :meth:`Server.supervise` returns non-zero. The exception is a replica's death while
another replica lives (with ``--serve-on-replica-death``, the default): the
frontend is told (``ProcessFailed``) and fails that replica's requests alone, the
replica's other processes are stopped, and the others serve on; the server stops
when its last replica dies. SIGINT/SIGTERM (:func:`stop_on_signals`) stop everything within a few
seconds. Children also get SIGTERM from the kernel if the supervisor itself is killed
(PR_SET_PDEATHSIG), so no process is ever orphaned.

Across nodes (``--nnodes N``): node 0 starts as above with its share of the ranks; node
``R > 0`` first joins node 0 over the node link (:mod:`conveyor.assembly.node_link`: the
cluster key, then the settings every node must share), then starts its ranks alone (no rings,
frontend, scheduler or HTTP process) and reports ready once they have joined node 0's process
group. Each node watches its own children: a rank that dies stops its node. The supervisors
watch each other over the link, idle or not: a node whose bin/serve exits, or whose host goes
silent (within ``node_link.silence_bound``), stops node 0, which answers every in-flight
request with an error naming that node, and node 0 stopping or lost stops the others. The
ranks notice too (a collective fails within ``--distributed-timeout``; a remote rank's plan
socket reports node 0 lost, conveyor.ipc.step_receivers.RemoteReceiver); a dead rank is then
reported as the node the link lost, when it lost one.

bin/serve (:mod:`conveyor.cli.serve`) is flags, this, and its messages.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import shutil
import signal
import sys
import time

import zmq

from conveyor.assembly import node_link
from conveyor.ipc import codec, step_channel, transport
from conveyor.ipc.messages import ProcessFailed, ProcessReady, Shutdown
from conveyor.ipc.transport import ClusterKey
from conveyor.runtime.config import ServerConfig, rank_process_name, replica_of_process, replica_process_name
from conveyor.runtime.model_source import StartupError
from conveyor.runtime.process import HANG_EXIT_CODE, SHUTDOWN_GRACE_S, run_entry, run_entry_when_sent, terminate

STARTUP_TIMEOUT_S = 600.0
CAUSE_GRACE_S = 5.0  # how long a dead scheduler's worker may take to exit too (Server._cause)
LOST_NODE_GRACE_S = 1.0  # how long a dead worker's node link may take to report the node it lost

# Each child's body, imported by the child alone (conveyor.runtime.process.run_entry).
RUN_WORKER = "conveyor.worker.main:run_worker"
RUN_FRONTEND = "conveyor.frontend.main:run_frontend"
RUN_HTTP = "conveyor.http.main:run_http"
RUN_SCHEDULER = "conveyor.scheduler.main:run_scheduler"


class Server:
    """The children (worker, frontend, scheduler, and the HTTP process when asked for) and
    the sockets serve uses to talk to them."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.control = transport.socket(self.ctx, zmq.PULL, config.addresses.control, bind=True)
        self.frontend_control = transport.socket(self.ctx, zmq.PUSH, config.addresses.frontend_control, bind=False)
        self.mp = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.unsent: dict[str, mp.connection.Connection] = {}  # children started before their config, by name
        self.ready: dict[str, ProcessReady] = {}
        self.dead_replicas: set[int] = set()  # data-parallel replicas stopped while the others serve on
        self.link: node_link.NodeLinkHub | node_link.NodeLinkMember | None = None  # with --nnodes > 1

    # ------------------------------------------------------------------ startup

    def start(self) -> None:
        config = self.config
        if config.nnodes > 1:
            self._open_link()
        if config.node_rank > 0:
            self._start_ranks_only()
            return
        replicas = [config.replica(index) for index in range(config.data_parallel_size)]
        try:
            for replica in replicas:
                step_channel.create_rings(replica.channels)
        except OSError as exc:
            raise StartupError(
                f"cannot create the shared-memory plan rings ({exc}); --plan-transport zmq avoids them"
            ) from None
        first = {"frontend"}
        for index, replica in enumerate(replicas):  # every data-parallel replica's workers
            for rank in replica.worker_ranks():  # every tensor-parallel rank, each watched like any child
                name = rank_process_name(replica_process_name("worker", index), rank.tensor_parallel_rank)
                self._spawn(name, RUN_WORKER, rank)
                first.add(name)
        self._spawn("frontend", RUN_FRONTEND, config.frontend)
        if config.http is not None:  # it answers 503 until the scheduler is up
            self._spawn("http", RUN_HTTP, config.http)
            first.add("http")
        schedulers = {replica_process_name("scheduler", index) for index in range(len(replicas))}
        for name in sorted(schedulers):  # importing while the workers load; sized by them below
            self._spawn_unsent(name, RUN_SCHEDULER)
        self._wait_ready(first)
        for index, replica in enumerate(replicas):
            worker = self.ready[replica_process_name("worker", index)].info
            try:
                scheduler = replica.sized_scheduler(
                    num_blocks=int(worker["num_blocks"]),
                    num_cpu_blocks=int(worker.get("num_cpu_blocks", 0)),
                    block_bytes=int(worker.get("block_bytes", 0)),
                )
            except ValueError as exc:
                raise StartupError(str(exc)) from None
            self._send_config(replica_process_name("scheduler", index), scheduler)
        self._wait_ready(schedulers)

    def _open_link(self) -> None:
        """The node link (:mod:`conveyor.assembly.node_link`): node 0 binds it, another node joins
        through it before it starts any rank (StartupError if node 0 refuses or never answers)."""
        config = self.config
        key = ClusterKey.load(config.cluster_key) if config.cluster_key is not None else None
        address = node_link.node_link_address(config.dist_init_addr)
        settings = node_link.join_settings(config)
        silence = node_link.silence_bound(config.worker.distributed_timeout_s)
        if config.node_rank == 0:
            self.link = node_link.NodeLinkHub(self.ctx, address, key, config.nnodes, settings, silence)
            return
        self.link = node_link.NodeLinkMember(self.ctx, address, key, config.node_rank, settings, silence)
        self.link.join(config.worker.distributed_timeout_s, lambda: bool(_STOP_SIGNAL))

    def _start_ranks_only(self) -> None:
        """Node ``node_rank > 0``: this node's tensor-parallel ranks, ready once they have
        joined the group (which needs node 0's ranks too) and agreed on the KV pool."""
        names = set()
        for rank in self.config.worker_ranks():
            name = rank_process_name("worker", rank.tensor_parallel_rank)
            self._spawn(name, RUN_WORKER, rank)
            names.add(name)
        self._wait_ready(names)

    def _spawn(self, name: str, entry: str, config) -> None:
        proc = self.mp.Process(target=run_entry, args=(entry, config), name=f"conveyor-{name}")
        proc.start()
        self.procs[name] = proc

    def _spawn_unsent(self, name: str, entry: str) -> None:
        """Start child ``name`` before its config exists (:meth:`_send_config` sends it)."""
        receive, send = self.mp.Pipe(duplex=False)
        proc = self.mp.Process(target=run_entry_when_sent, args=(entry, receive), name=f"conveyor-{name}")
        proc.start()
        receive.close()
        self.procs[name] = proc
        self.unsent[name] = send

    def _send_config(self, name: str, config) -> None:
        send = self.unsent.pop(name)
        try:
            send.send(config)
        except OSError:
            pass  # the child died waiting: _wait_ready reports it
        finally:
            send.close()

    def _wait_ready(self, names: set[str]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(names)
        while waiting:
            if _STOP_SIGNAL:
                raise StartupError("interrupted during startup")
            for name in waiting:
                if not self.procs[name].is_alive():
                    raise StartupError(f"{name} process exited during startup (exit code {self.procs[name].exitcode})")
            if time.monotonic() > deadline:
                raise StartupError(f"timed out waiting for {', '.join(sorted(waiting))} to start")
            lost = self.link.watch(starting=True) if self.link is not None else None
            if lost is not None:
                raise StartupError(lost.reason)
            if not self.control.poll(200):
                continue
            msg = codec.decode(self.control.recv())
            if isinstance(msg, ProcessFailed):
                raise StartupError(msg.reason)
            if isinstance(msg, ProcessReady):
                # By pid: every replica's processes report the same names ("worker", "scheduler").
                name = next((n for n, p in self.procs.items() if p.pid == msg.pid), msg.process)
                self.ready[name] = msg
                waiting.discard(name)
                print(f"conveyor: {name} ready (pid {msg.pid})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ supervision

    def supervise(self) -> int:
        """Block until a signal or a child's death; return serve's exit code."""
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        while True:
            if _STOP_SIGNAL:
                self.stop(node_link.SIGNAL_REASON)
                return 0
            lost = self.link.watch() if self.link is not None else None
            if lost is not None:
                return self._stop_for(lost)
            done = mp.connection.wait(list(sentinels), timeout=0.2)
            if done:
                time.sleep(0.1)  # a signal sent to the whole group reaches us a moment later
                for s in done:
                    self.procs[sentinels[s]].join(1.0)  # its exit code, for _cause
                name = self._cause([sentinels[s] for s in done], sentinels)
                self.procs[name].join(1.0)
                code = self.procs[name].exitcode
                if _STOP_SIGNAL:
                    self.stop(node_link.SIGNAL_REASON)
                    return 0
                replica = replica_of_process(name)
                if replica is not None and self._serves_on_without(replica):
                    print(
                        f"conveyor: {_death(name, code)}; stopping replica {replica}, serving on the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    for gone in self.stop_replica(replica, name, _death(name, code)):
                        sentinels.pop(self.procs[gone].sentinel, None)
                    continue
                reason = _death(name, code)
                if self.config.nnodes > 1 and name.startswith("worker"):
                    # A collective with a dead node, or a lost plan socket: the link names the node.
                    lost = self._node_lost_within(LOST_NODE_GRACE_S)
                    if lost is not None:
                        return self._stop_for(lost, f" ({reason})")
                    reason += f"; with --nnodes {self.config.nnodes}, another node may have died or lost contact"
                print(f"conveyor: {reason}; stopping", file=sys.stderr, flush=True)
                self.stop(reason)
                return 1

    def _cause(self, dead: list[str], sentinels: dict) -> str:
        """Which of the children found dead to report. A failing worker closes its result
        ring on the way out, so its scheduler may exit (PeerGone) before the worker does: a
        scheduler that exited on its own (status 1, as PeerGone ends it; a killed one has no
        cause to wait for) waits up to :data:`CAUSE_GRACE_S` for a worker that dies too, and a
        worker, the cause, is reported over a scheduler."""
        deadline = time.monotonic() + CAUSE_GRACE_S
        if not any(name.startswith("scheduler") and self.procs[name].exitcode == 1 for name in dead):
            deadline = 0.0
        while not any(name.startswith("worker") for name in dead) and time.monotonic() < deadline:
            found = mp.connection.wait(list(sentinels), timeout=0.05)
            dead = [sentinels[s] for s in found] or dead
        return min(dead, key=lambda name: not name.startswith("worker"))

    def _stop_for(self, lost: node_link.NodeStop, detail: str = "") -> int:
        """Stop for what the node link reported (``detail``: the dead rank it explains); serve's
        exit code: 0 when node 0 stopped on a signal, else 1."""
        reason = lost.reason + detail
        print(f"conveyor: {reason}; stopping", file=sys.stderr, flush=True)
        self.stop(reason)
        return 0 if lost.clean else 1

    def _node_lost_within(self, seconds: float) -> node_link.NodeStop | None:
        """What the node link reports within ``seconds`` (None: every node is still there)."""
        deadline = time.monotonic() + seconds
        while True:
            lost = self.link.watch()
            if lost is not None or time.monotonic() > deadline:
                return lost
            time.sleep(0.05)

    def _serves_on_without(self, replica: int) -> bool:
        """Whether the server keeps serving when ``replica`` dies: --serve-on-replica-death
        (the default) and another replica is still alive."""
        if not self.config.serve_on_replica_death:
            return False
        others = set(range(self.config.data_parallel_size)) - self.dead_replicas - {replica}
        return bool(others)

    def stop_replica(self, replica: int, process: str, reason: str) -> list[str]:
        """Replica ``replica`` lost ``process``: tell the frontend (which fails that replica's
        requests alone and routes nothing there again), stop the replica's other processes,
        and return the names of all of them."""
        self.dead_replicas.add(replica)
        transport.send(self.frontend_control, ProcessFailed(process, reason))
        names = [name for name in self.procs if replica_of_process(name) == replica]
        terminate([self.procs[name] for name in names])
        return names

    def stop(self, reason: str) -> None:
        """Tell the other nodes (node 0), fail in-flight requests through the frontend, then
        stop every child."""
        if isinstance(self.link, node_link.NodeLinkHub):
            self.link.stop(reason)
        frontend = self.procs.get("frontend")
        if frontend is not None and frontend.is_alive():
            transport.send(self.frontend_control, Shutdown(reason))
            frontend.join(SHUTDOWN_GRACE_S)
        terminate(list(self.procs.values()))

    def close(self) -> None:
        for send in self.unsent.values():
            send.close()
        if self.link is not None:
            self.link.close()
        self.control.close(linger=0)
        self.frontend_control.close(linger=0)
        self.ctx.term()
        for index in range(self.config.data_parallel_size if self.config.node_rank == 0 else 0):
            step_channel.remove_rings(self.config.replica(index).channels)
        shutil.rmtree(self.config.run_dir, ignore_errors=True)


def _death(name: str, code: int | None) -> str:
    """Why child ``name`` ended with exit status ``code``, for bin/serve and the clients."""
    if name.startswith("scheduler") and code == HANG_EXIT_CODE:
        return f"{name} process stopped: its worker hung (no step result within --hang-timeout; --on-hang exit)"
    if name == "frontend" and code == HANG_EXIT_CODE:
        return "frontend process stopped: a scheduler hung (no answer within --hang-timeout; --on-hang exit)"
    return f"{name} process died (exit code {code})"


_STOP_SIGNAL: list[int] = []


def _on_signal(signum, frame) -> None:
    _STOP_SIGNAL.append(signum)


def stop_on_signals() -> None:
    """SIGINT and SIGTERM from now on ask a starting or supervising :class:`Server` to stop
    (it checks between waits), rather than interrupting it wherever it is."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
