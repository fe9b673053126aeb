"""Tensor parallelism across nodes, on one machine: two ``bin/serve`` invocations on loopback
(``--nnodes 2``, node 0 and node 1, one rank each, gloo on CPU), end to end.

Node 1 joins node 0 over the node link (CurveZMQ with the cluster key), runs rank 1 alone
and reads node 0's plans over TCP; both ranks meet at ``--dist-init-addr``. Greedy tokens
equal those of the same tensor-parallel size on one node and HF transformers'. Killing node 1
(its bin/serve by SIGKILL, so its rank goes with it) with requests in flight answers every
one of them with an error naming node 1 and stops node 0; a node 1 gone silent (SIGSTOP)
while node 0 is idle stops node 0 within the link's silence bound; a node with another
cluster key, or other settings, is refused with an error saying why; a node 1 that never
starts makes node 0's start-up fail with a clear error within ``--distributed-timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conveyor.client import Client
from tests.e2e.serve_harness import SERVE, alive, children_of, kill_during_streams, still_alive_after
from tests.e2e.test_tensor_parallel_serve import TP_ARGS, N, generate_all, max_tokens, prompt

TIMEOUT_S = 20  # --distributed-timeout


def free_ports(count: int = 3) -> int:
    """A loopback port free together with the next ``count - 1`` (the store, node 0's node
    link, then node 1's plan socket)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise AssertionError("no free run of loopback ports")


class Node:
    """A ``--node-rank R > 0`` bin/serve in a subprocess (it becomes ready only with node 0)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line)
            if "ready: tensor-parallel ranks" in line:
                self.ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def kill_tree(self) -> None:
        for pid in [*children_of(self.proc.pid), self.proc.pid]:
            if alive(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
        self.proc.wait(10)


@pytest.fixture
def node_factory():
    started: list[Node] = []

    def start(*args: str) -> Node:
        node = Node(list(args))
        started.append(node)
        return node

    yield start
    for node in started:
        if node.proc.poll() is None:
            node.kill_tree()


@pytest.fixture(scope="module")
def cluster_key(tmp_path_factory) -> str:
    from conveyor.cli.keygen import make_cluster_key

    return make_cluster_key(str(tmp_path_factory.mktemp("keys")))


def node_args(port: int, rank: int, key: str) -> list[str]:
    return [
        *TP_ARGS, "--device", "cpu", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{port}",
        "--cluster-key", key,
    ]  # fmt: skip


def test_two_nodes_match_one_node_and_hf_then_a_dead_node_stops_the_server(
    serve_factory, node_factory, tiny_checkpoint, hf_greedy, cluster_key
) -> None:
    one_node = serve_factory("--model", str(tiny_checkpoint), *TP_ARGS, "--device", "cpu")
    expected = generate_all(one_node.address)
    assert one_node.terminate() == 0

    port = free_ports()
    args = ["--model", str(tiny_checkpoint), "--distributed-timeout", str(TIMEOUT_S)]
    node1 = node_factory(*node_args(port, 1, cluster_key), *args)
    node0 = serve_factory(*node_args(port, 0, cluster_key), *args)
    assert node1.ready.wait(30), node1.output()
    assert "with 40 KV blocks" in node0.output()
    with pytest.raises(AssertionError):  # node 0 runs rank 0 only: rank 1 is node 1's
        node0._pid_of("worker-rank1")
    rank1 = int(node1.output().split("worker-rank1 ready (pid ")[1].split(")")[0])
    assert rank1 in children_of(node1.proc.pid)

    outputs = generate_all(node0.address)
    for i in range(N):
        assert outputs[i] == expected[i] == hf_greedy(prompt(i), max_tokens(i)), i

    # The node dies: its bin/serve by SIGKILL, its rank (PR_SET_PDEATHSIG) with it.
    outcomes = asyncio.run(
        kill_during_streams(node0.address, node1.proc.pid, num_requests=3, max_tokens=200, timeout=60)
    )
    for d, _ in outcomes:
        assert not isinstance(d, Exception), d
        assert d.finish_reason == "error" and "lost contact with node 1" in d.result.error, d
    assert max(seconds for _, seconds in outcomes) < TIMEOUT_S
    assert node0.proc.wait(15) != 0
    assert not still_alive_after([*node0.pids.values(), rank1], 5)


def test_an_idle_node_0_stops_when_node_1_goes_silent_and_a_wrong_key_is_refused(
    serve_factory, node_factory, tiny_checkpoint, tmp_path, cluster_key
) -> None:
    """Nothing in flight, so no collective would notice: the node link does. Node 1's whole
    tree is stopped (SIGSTOP: its host gone silent, the hardest case, since no connection is
    closed); node 0 reports it and exits within the link's silence bound (the distributed
    timeout here). Before that, a bin/serve with another cluster key is refused at the
    handshake, says why, and disturbs nothing."""
    from conveyor.cli.keygen import make_cluster_key

    port, silence = free_ports(), 8
    args = ["--model", str(tiny_checkpoint), "--distributed-timeout", str(silence)]
    node1 = node_factory(*node_args(port, 1, cluster_key), *args)
    node0 = serve_factory(*node_args(port, 0, cluster_key), *args)
    assert node1.ready.wait(30), node1.output()

    wrong_key = make_cluster_key(str(tmp_path / "other"))
    intruder = subprocess.run(
        [sys.executable, str(SERVE), *node_args(port, 1, wrong_key), *args], capture_output=True, text=True, timeout=60
    )
    assert intruder.returncode == 1 and "refused this node's cluster key" in intruder.stderr, intruder.stderr
    assert "worker" not in intruder.stderr  # refused before it started a rank
    assert "refused a connection to the node link" in node0.output()
    with Client(node0.address, timeout=60) as client:  # still serving, on both nodes
        assert len(client.generate(token_ids=prompt(1), max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4

    stopped_at = time.monotonic()
    for pid in [node1.proc.pid, *children_of(node1.proc.pid)]:
        os.kill(pid, signal.SIGSTOP)
    code = node0.proc.wait(silence + 20)
    took = time.monotonic() - stopped_at
    assert code == 1
    assert "lost contact with node 1" in node0.output() and f"silent for {silence} s" in node0.output()
    assert took < silence + 10, took  # the bound, plus a heartbeat and the stop, on a busy host
    print(f"node 0 exited {took:.1f} s after node 1 went silent (bound {silence} s)")
    assert not still_alive_after(list(node0.pids.values()), 5)


def test_a_node_with_other_settings_is_refused_and_both_nodes_say_why(tiny_checkpoint, tmp_path, cluster_key) -> None:
    port = free_ports()
    args = ["--model", str(tiny_checkpoint), "--distributed-timeout", "20"]
    node0 = subprocess.Popen(
        [sys.executable, str(SERVE), "--host", f"ipc://{tmp_path}/c.sock", *node_args(port, 0, cluster_key), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    node1 = subprocess.run(
        [sys.executable, str(SERVE), *node_args(port, 1, cluster_key), *args, "--block-size", "16"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _, node0_err = node0.communicate(timeout=60)
    assert node1.returncode == 1 and "refused this node: --block-size: node 1 has '16', node 0 '8'" in node1.stderr, (
        node1.stderr
    )
    assert node0.returncode == 1 and "node 1 cannot join: --block-size" in node0_err, node0_err


def test_a_node_that_never_starts_fails_node_0_within_the_timeout(tiny_checkpoint, tmp_path, cluster_key) -> None:
    port = free_ports()
    cmd = [sys.executable, str(SERVE), "--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c.sock"]
    cmd += [*node_args(port, 0, cluster_key), "--distributed-timeout", "5"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    assert "startup failed" in done.stderr and "tensor-parallel ranks did not all join" in done.stderr, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr
    assert took < 5 + 25, took  # the timeout, plus start-up (interpreters, model load) on a busy 2-core host


def test_the_flags_split_the_ranks_over_the_nodes_and_send_remote_plans_over_tcp(tmp_path, cluster_key) -> None:
    """No process: what --nnodes puts in each node's configuration."""
    from conveyor.cli.serve import build_parser, server_config

    def config(*flags: str):
        return server_config(
            build_parser().parse_args(["--model", "demo", "--num-kv-blocks", "8", *flags]), str(tmp_path)
        )

    remote = ("--tensor-parallel-size", "4", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000")
    multi = (*remote, "--cluster-key", cluster_key)
    node0, node1 = config(*multi), config(*multi, "--node-rank", "1")
    assert [w.tensor_parallel_rank for w in node0.worker_ranks()] == [0, 1]
    assert [w.tensor_parallel_rank for w in node1.worker_ranks()] == [2, 3]
    assert {w.distributed_init_method for w in node1.worker_ranks()} == {"tcp://10.0.0.1:5000"}
    plans = node0.channels.plans
    assert plans.readers == 4 and plans.num_local_readers == 2 and node1.channels.plans == plans
    assert [plans.is_remote(r) for r in range(4)] == [False, False, True, True]
    assert plans.reader_address(1).startswith("ipc://")
    assert [plans.reader_address(r) for r in (2, 3)] == ["tcp://10.0.0.1:5002", "tcp://10.0.0.1:5003"]
    assert plans.remote_key == cluster_key and node0.cluster_key == cluster_key
    assert node0.channels.results.readers == 1
    loopback = ("--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000")
    assert config(*loopback, "--insecure-cluster").channels.plans.remote_key is None
    for flags, error in [
        (remote, "needs one of --cluster-key FILE"),
        ((*multi, "--insecure-cluster"), "needs one of --cluster-key FILE"),
        ((*remote, "--insecure-cluster"), "--insecure-cluster is for loopback only: 10.0.0.1"),
        ((*remote, "--cluster-key", str(tmp_path / "missing")), "--cluster-key .*missing"),
        (("--tensor-parallel-size", "3", *multi[2:]), "does not divide by --nnodes 2"),
        (("--tensor-parallel-size", "2", "--nnodes", "2"), "needs --dist-init-addr"),
        ((*multi, "--node-rank", "2"), "--node-rank 2 outside 0..1"),
        (("--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", "nohost"), "HOST:PORT"),
        ((*multi, "--data-parallel-size", "2"), "--data-parallel-size must be 1"),
    ]:
        with pytest.raises(ValueError, match=error):
            config(*flags)


def test_a_remote_reader_gets_every_plan_in_order_and_sees_the_sender_go() -> None:
    """No server: the step channel with one local and one remote reader (ZeroMQ locally)."""
    import tempfile

    import zmq

    from conveyor.ipc.messages import Shutdown
    from conveyor.ipc.step_channel import ChannelSpec, PeerGone, StepSender
    from conveyor.ipc.step_receivers import RemoteReceiver, StepReceiver

    port = free_ports(1)
    with tempfile.TemporaryDirectory() as run_dir:
        spec = ChannelSpec(
            f"ipc://{run_dir}/plans", readers=2, local_readers=1, remote_address=f"tcp://127.0.0.1:{port}"
        )
        ctx = zmq.Context()
        remote = StepReceiver(ctx, spec, bind=False, reader=1)
        local = StepReceiver(ctx, spec, bind=False, reader=0)
        assert isinstance(remote, RemoteReceiver)
        assert not remote.wait(0.2)  # connecting before the sender binds loses nothing
        sender = StepSender(ctx, spec, bind=True)
        for reason in ("a", "b", "c"):
            sender.send(Shutdown(reason))
        assert [remote.recv(5).reason for _ in range(3)] == ["a", "b", "c"]
        assert [local.recv(5).reason for _ in range(3)] == ["a", "b", "c"]
        sender.send(Shutdown("last"))
        sender.close()  # the sender's node goes: what it sent is still read, then PeerGone
        assert remote.recv(5).reason == "last"
        with pytest.raises(PeerGone, match="lost the connection to node 0"):
            remote.wait(10)
        for end in (remote, local):
            end.close()
        ctx.term()
