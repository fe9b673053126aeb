"""The sockets between nodes, without a server: the node link (joining, refusals, a lost or
stopping peer; conveyor.assembly.node_link) and the plan channel's remote readers with the
cluster key (CurveZMQ: a reader without the key gets no plan and is told why)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from conveyor.assembly import node_link
from conveyor.cli.keygen import make_cluster_key
from conveyor.ipc.messages import Shutdown
from conveyor.ipc.step_channel import ChannelSpec, PeerGone, StepSender
from conveyor.ipc.step_receivers import StepReceiver
from conveyor.ipc.transport import ClusterKey
from conveyor.runtime.model_source import StartupError

SETTINGS = {"conveyor version": "1.0", "--block-size": "8"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def keys(tmp_path):
    """The cluster key pair file, and another (a node with the wrong key)."""
    return make_cluster_key(str(tmp_path / "a")), make_cluster_key(str(tmp_path / "b"))


@pytest.fixture
def hub(keys):
    ctx = zmq.Context()
    link = node_link.NodeLinkHub(ctx, f"tcp://127.0.0.1:{free_port()}", ClusterKey.load(keys[0]), 2, SETTINGS, 2.0)
    yield link
    link.close()
    ctx.term()


@pytest.fixture
def member_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes what a failed test left open, instead of waiting on it


def join(hub, ctx, key_file: str | None, settings: dict[str, str], rank: int = 1):
    """Node ``rank`` joining ``hub`` while the hub answers: (the member, or the StartupError
    its join raised; the StartupError the hub raised, or None)."""
    key = ClusterKey.load(key_file) if key_file is not None else None
    member = node_link.NodeLinkMember(ctx, hub.address, key, rank, settings, 2.0)
    hub_error: list[StartupError] = []
    done = threading.Event()

    def answer() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and rank not in hub.joined and not done.is_set():
            try:
                hub.admit()
            except StartupError as exc:
                hub_error.append(exc)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        member.join(5, lambda: False)
        joined = member
    except StartupError as exc:
        member.close()
        joined = exc
    time.sleep(0.1)  # the hub's last pass: it may raise just after its verdict went out
    done.set()
    thread.join()
    return joined, (hub_error[0] if hub_error else None)


def wait_for(watch, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = watch()
        if found is not None:
            return found
        time.sleep(0.02)
    return None


def test_a_node_joins_then_its_loss_and_node_0_stopping_are_seen(hub, member_ctx, keys) -> None:
    member, hub_error = join(hub, member_ctx, keys[0], SETTINGS)
    assert hub_error is None and set(hub.joined) == {1}
    assert hub.watch() is None and member.watch() is None
    hub.stop(node_link.SIGNAL_REASON)
    stop = wait_for(member.watch, 2)
    assert stop == node_link.NodeStop("node 0 stopped (server shutting down)", clean=True)
    member.close()
    lost = wait_for(hub.watch, 2)  # the member's process closed its connection: seen at once
    assert lost is not None and not lost.clean and "lost contact with node 1" in lost.reason


def test_node_0_lost_is_seen_by_the_member(keys, member_ctx) -> None:
    ctx = zmq.Context()
    hub = node_link.NodeLinkHub(ctx, f"tcp://127.0.0.1:{free_port()}", ClusterKey.load(keys[0]), 2, SETTINGS, 2.0)
    member, _ = join(hub, member_ctx, keys[0], SETTINGS)
    hub.close()
    ctx.term()
    stop = wait_for(member.watch, 2)
    member.close()
    assert stop is not None and not stop.clean and f"lost contact with node 0 at {hub.address}" in stop.reason


def test_a_node_gone_silent_is_seen_within_the_silence_bound(hub, keys) -> None:
    """Node 1 in another process, stopped (SIGSTOP: its connection stays open, nothing
    answers): only the missing heartbeats tell, within ``silence_s`` (2 s here) and a beat."""
    child = subprocess.Popen([sys.executable, "-c", f"""
import time, zmq
from conveyor.ipc.transport import ClusterKey
from conveyor.assembly import node_link
member = node_link.NodeLinkMember(zmq.Context(), {hub.address!r}, ClusterKey.load({keys[0]!r}), 1, {SETTINGS!r}, 2.0)
member.join(30, lambda: False)
print("joined", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not hub.joined and time.monotonic() < deadline:
            hub.admit()
            time.sleep(0.02)
        assert child.stdout.readline() == "joined\n"
        assert hub.watch() is None
        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        lost = wait_for(hub.watch, 10)
        took = time.monotonic() - stopped
    finally:
        child.kill()
        child.wait()
    assert lost is not None and "lost contact with node 1" in lost.reason and "silent for 2 s" in lost.reason
    assert 1.5 < took < 2.0 + node_link.HEARTBEAT_S + 1.0, took


def test_a_node_with_other_settings_is_refused_and_both_say_which(hub, member_ctx, keys) -> None:
    member_error, hub_error = join(hub, member_ctx, keys[0], {**SETTINGS, "--block-size": "16"})
    assert "refused this node: --block-size: node 1 has '16', node 0 '8'" in str(member_error)
    assert "node 1 cannot join: --block-size: node 1 has '16', node 0 '8'" in str(hub_error)
    assert not hub.joined


def test_a_node_with_another_cluster_key_is_refused_at_the_handshake(hub, member_ctx, keys, capfd) -> None:
    member_error, hub_error = join(hub, member_ctx, keys[1], SETTINGS)
    assert "refused this node's cluster key" in str(member_error) and hub_error is None
    assert not hub.joined
    assert "refused a connection to the node link" in capfd.readouterr().err


def test_differences_name_each_setting_that_differs() -> None:
    ours = {"conveyor commit": "abc", "torch version": "2.5", "--nnodes": "2"}
    theirs = {"conveyor commit": "def", "torch version": "2.5"}
    assert node_link.differences(3, theirs, ours) == (
        "--nnodes: node 3 has '(none)', node 0 '2'; conveyor commit: node 3 has 'def', node 0 'abc'"
    )
    assert node_link.differences(1, ours, dict(ours)) == ""


def test_with_the_cluster_key_only_a_key_holder_reads_plans(keys, tmp_path) -> None:
    """Node 0's plan socket for a remote rank: the holder of the key gets every plan, in
    order; a reader with another key is refused (PeerGone saying so), and neither one without
    CurveZMQ nor one with the cluster's public key but another pair gets anything (none becomes
    a peer, so none takes a plan from the holder either: PUSH would deal them round-robin)."""
    port = free_port()
    spec = ChannelSpec(
        f"ipc://{tmp_path}/plans",
        readers=2,
        local_readers=1,
        remote_address=f"tcp://127.0.0.1:{port}",
        remote_key=keys[0],
    )
    ctx = zmq.Context()
    sender = StepSender(ctx, spec, bind=True)
    local = StepReceiver(ctx, spec, bind=False, reader=0)
    wrong = StepReceiver(ctx, dataclasses.replace(spec, remote_key=keys[1]), bind=False, reader=1)
    plain = ctx.socket(zmq.PULL)
    plain.connect(f"tcp://127.0.0.1:{port}")
    # One that knows the cluster's public key (it is in no secret) but holds another pair: ZAP refuses it.
    impostor = ctx.socket(zmq.PULL)
    other = ClusterKey.load(keys[1])
    impostor.curve_publickey, impostor.curve_secretkey = other.public, other.secret
    impostor.curve_serverkey = ClusterKey.load(keys[0]).public
    impostor.connect(f"tcp://127.0.0.1:{port}")
    with pytest.raises(PeerGone, match="refused this node's cluster key"):
        wrong.wait(5)
    holder = StepReceiver(ctx, spec, bind=False, reader=1)
    for reason in ("a", "b", "c"):
        sender.send(Shutdown(reason))
    assert [holder.recv(5).reason for _ in range(3)] == ["a", "b", "c"]
    assert [local.recv(5).reason for _ in range(3)] == ["a", "b", "c"]
    assert not plain.poll(300) and not impostor.poll(0)
    for end in (holder, wrong, local, sender):
        end.close()
    plain.close(linger=0)
    impostor.close(linger=0)
    ctx.term()


def test_without_keys_nodes_join_and_a_key_holder_is_refused(keys, member_ctx) -> None:
    """--insecure-cluster on both nodes joins; a node with --cluster-key against a node 0
    without is refused at the handshake, saying so."""
    ctx = zmq.Context()
    hub = node_link.NodeLinkHub(ctx, f"tcp://127.0.0.1:{free_port()}", None, 3, SETTINGS, 2.0)
    plain, _ = join(hub, member_ctx, None, SETTINGS)
    keyed, _ = join(hub, member_ctx, keys[0], SETTINGS, rank=2)
    for end in (plain, keyed, hub):
        if not isinstance(end, Exception):
            end.close()
    ctx.term()
    assert isinstance(plain, node_link.NodeLinkMember) and set(hub.joined) == {1}
    assert "refused this node's cluster key" in str(keyed) and "--insecure-cluster" in str(keyed)


def test_keygen_makes_one_private_cluster_key_and_keeps_it(tmp_path) -> None:
    from conveyor.cli.keygen import main

    assert main([str(tmp_path), "--cluster"]) == 0
    secret = tmp_path / "cluster.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    before = secret.read_bytes()
    assert make_cluster_key(str(tmp_path)) == str(secret) and secret.read_bytes() == before  # every node needs the same
    key = ClusterKey.load(str(secret))
    assert key.callback("*", key.public) and not key.callback(
        "*", ClusterKey.load(make_cluster_key(str(tmp_path / "x"))).public
    )
    with pytest.raises(ValueError, match="holds no secret key"):
        ClusterKey.load(str(tmp_path / "cluster.key"))
