"""CurveZMQ authentication (bin/serve --auth-keys DIR, bin/keygen): the right key pair is
served and identified by its public key; a wrong, unknown, revoked or missing key, or a
wrong server key, is refused with AuthenticationError as soon as the handshake fails,
never a hang (issue 17, "Authentication").

The stand-in server (tests.reliability.fake_server) binds the frontend's own client socket
(:func:`conveyor.ipc.transport.bind_client_socket`) and puts the connection's ZAP User-Id
in each final's ``text``; one bin/serve test checks the flag's wiring end to end.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request

import pytest
import zmq.auth

from conveyor.cli import keygen
from conveyor.cli.serve import build_parser, server_config, warn_if_exposed
from conveyor.client import AsyncClient, AuthenticationError, Client
from conveyor.ipc import transport
from tests.e2e.serve_harness import REPO
from tests.http.conftest import http_serve

REFUSAL_TIMEOUT_S = 30.0  # a refusal is seen at the first handshake; waiting this long is the failure


@pytest.fixture
def keys(tmp_path) -> dict[str, str]:
    """A key directory with clients ``alice`` and ``bob``, and a stranger's pair made elsewhere."""
    keys_dir = str(tmp_path / "keys")
    assert keygen.main([keys_dir, "--client", "alice"]) == 0  # the server's pair is made on the way
    assert keygen.main([keys_dir]) == 0
    assert keygen.main([keys_dir, "--client", "bob"]) == 0
    other = str(tmp_path / "other")
    keygen.make_server_keys(other)
    return {
        "dir": keys_dir,
        "server": transport.server_public_key_file(keys_dir),
        "alice": os.path.join(transport.client_keys_dir(keys_dir), "alice.key_secret"),
        "bob": os.path.join(transport.client_keys_dir(keys_dir), "bob.key_secret"),
        "stranger": keygen.make_client_keys(other, "stranger"),
        "other_server": transport.server_public_key_file(other),
    }


def test_keygen_output_loads(keys) -> None:
    transport.check_auth_keys(keys["dir"])
    public, secret = zmq.auth.load_certificate(keys["alice"])
    assert len(public) == 40 and len(secret) == 40
    assert public in zmq.auth.load_certificates(transport.client_keys_dir(keys["dir"]))
    assert oct(os.stat(keys["alice"]).st_mode & 0o777) == "0o600"
    server_public, server_secret = zmq.auth.load_certificate(transport.server_secret_key_file(keys["dir"]))
    assert server_secret is not None and zmq.auth.load_certificate(keys["server"])[0] == server_public
    assert keygen.main([keys["dir"]]) == 0  # kept, not replaced: its clients keep working
    assert zmq.auth.load_certificate(keys["server"])[0] == server_public
    assert keygen.main([keys["dir"], "--client", "alice"]) == 1  # a name in use is never overwritten
    assert zmq.auth.load_certificate(keys["alice"])[0] == public


def test_check_auth_keys_refuses_an_incomplete_directory(tmp_path) -> None:
    with pytest.raises(ValueError, match="no server key pair"):
        transport.check_auth_keys(str(tmp_path))
    keygen.make_server_keys(str(tmp_path / "k"))
    os.rmdir(transport.client_keys_dir(str(tmp_path / "k")))
    with pytest.raises(ValueError, match="clients/"):
        transport.check_auth_keys(str(tmp_path / "k"))


def test_allowed_keys_are_served_and_identified(fake_server, keys) -> None:
    server = fake_server("--auth-keys", keys["dir"], "--answer")
    for name in ("alice", "bob"):
        with Client(server.address, timeout=10, client_key=keys[name], server_key=keys["server"]) as client:
            result = client.generate(prompt="hi")
        assert result.finish_reason == "stop"
        assert result.text == zmq.auth.load_certificate(keys[name])[0].decode()  # the User-Id is its public key

    async def scenario():
        async with AsyncClient(
            server.address, timeout=10, client_key=keys["alice"], server_key=keys["server"]
        ) as client:
            return await client.generate(prompt="hi")

    assert asyncio.run(scenario()).finish_reason == "stop"


def test_the_servers_own_key_pair_is_allowed(fake_server, keys) -> None:
    """What the HTTP process connects with under --auth-keys."""
    server = fake_server("--auth-keys", keys["dir"], "--answer")
    own = transport.server_secret_key_file(keys["dir"])
    with Client(server.address, timeout=10, client_key=own, server_key=keys["server"]) as client:
        assert client.generate(prompt="hi").finish_reason == "stop"


@pytest.mark.parametrize(
    "client_key, server_key, reason",
    [
        ("stranger", "server", "not allowed"),
        (None, None, "handshake failed"),
        ("alice", "other_server", "handshake failed"),
    ],
    ids=["unknown-key", "no-key", "wrong-server-key"],
)
def test_wrong_or_missing_keys_are_refused(fake_server, keys, client_key, server_key, reason) -> None:
    server = fake_server("--auth-keys", keys["dir"], "--answer")
    kwargs = {} if client_key is None else {"client_key": keys[client_key], "server_key": keys[server_key]}
    with Client(server.address, timeout=10, connect_timeout=REFUSAL_TIMEOUT_S, **kwargs) as client:
        with pytest.raises(AuthenticationError, match=reason):
            client.generate(prompt="hi")

    async def scenario():
        async with AsyncClient(server.address, timeout=10, connect_timeout=REFUSAL_TIMEOUT_S, **kwargs) as client:
            await client.generate(prompt="hi")

    with pytest.raises(AuthenticationError, match=reason):
        asyncio.run(scenario())


def test_a_deleted_client_key_is_refused_from_the_next_connection(fake_server, keys) -> None:
    server = fake_server("--auth-keys", keys["dir"], "--answer")
    os.unlink(os.path.join(transport.client_keys_dir(keys["dir"]), "bob.key"))
    with Client(
        server.address, connect_timeout=REFUSAL_TIMEOUT_S, client_key=keys["bob"], server_key=keys["server"]
    ) as client:
        with pytest.raises(AuthenticationError, match="not allowed"):
            client.generate(prompt="hi")


def test_client_key_needs_the_server_key(keys) -> None:
    with pytest.raises(ValueError, match="go together"):
        Client("ipc:///nonexistent", client_key=keys["alice"])
    with pytest.raises(ValueError, match="no secret key"):
        Client("ipc:///nonexistent", client_key=keys["server"], server_key=keys["server"])


def test_exposed_addresses_warn_once(tmp_path, keys, capsys) -> None:
    """Non-loopback without --auth-keys warns, with it (or on loopback) not; the HTTP
    listeners warn whenever they are exposed, having no authentication."""
    cases = [
        (["--host", "0.0.0.0"], 1),
        (["--host", "0.0.0.0", "--auth-keys", keys["dir"]], 0),
        (["--host", "127.0.0.1"], 0),
        (["--host", "127.0.0.1", "--http-port", "0", "--http-host", "::"], 1),
    ]
    for args, warnings in cases:
        run_dir = tmp_path / f"run{len(args)}-{warnings}"
        run_dir.mkdir()
        warn_if_exposed(server_config(build_parser().parse_args(["--model", "demo", *args]), str(run_dir)))
        err = capsys.readouterr().err
        assert err.count("WARNING") == warnings, (args, err)


def test_one_face_keyed_and_the_other_open_refuses_to_start(tmp_path, keys) -> None:
    """One auth story across faces (issue 43): a key on one face and the other reachable from
    other hosts without one is a start-up error naming both; loopback faces stay allowed."""
    refused = [
        (["--host", "0.0.0.0", "--http-port", "0", "--api-key", "k"], "--api-key keys the HTTP API"),
        (
            ["--host", "127.0.0.1", "--auth-keys", keys["dir"], "--http-port", "0", "--http-host", "0.0.0.0"],
            "--auth-keys keys the ZeroMQ socket",
        ),
    ]
    allowed = [
        ["--host", "127.0.0.1", "--http-port", "0", "--api-key", "k"],
        [
            "--host",
            "0.0.0.0",
            "--auth-keys",
            keys["dir"],
            "--http-port",
            "0",
            "--http-host",
            "0.0.0.0",
            "--api-key",
            "k",
        ],
        ["--host", "0.0.0.0", "--auth-keys", keys["dir"], "--http-port", "0"],
        ["--host", "0.0.0.0", "--http-port", "0", "--http-host", "0.0.0.0"],  # nothing keyed: the warnings say it
    ]
    for i, (args, message) in enumerate(refused):
        run_dir = tmp_path / f"refused{i}"
        run_dir.mkdir()
        with pytest.raises(ValueError, match=message):
            server_config(build_parser().parse_args(["--model", "demo", *args]), str(run_dir))
    for i, args in enumerate(allowed):
        run_dir = tmp_path / f"allowed{i}"
        run_dir.mkdir()
        server_config(build_parser().parse_args(["--model", "demo", *args]), str(run_dir))


def test_bin_serve_with_auth_keys(serve_factory, tiny_checkpoint, keys) -> None:
    """The flag end to end: an allowed key generates, no key is refused, and the HTTP process
    (a client of the frontend) gets in with the server's own key pair."""
    server = serve_factory(
        "--model",
        str(tiny_checkpoint),
        "--num-kv-blocks",
        "32",
        "--threads",
        "1",
        "--auth-keys",
        keys["dir"],
        "--http-port",
        "0",
    )
    with Client(server.address, timeout=60, client_key=keys["alice"], server_key=keys["server"]) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True, temperature=0)
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    with Client(server.address, timeout=10, connect_timeout=REFUSAL_TIMEOUT_S) as client:
        with pytest.raises(AuthenticationError):
            client.generate(token_ids=[5], max_tokens=1)
    with urllib.request.urlopen(f"{http_serve(server).url}/health", timeout=30) as response:
        assert response.status == 200
    bin_client = [
        sys.executable,
        str(REPO / "bin" / "client"),
        "--host",
        server.address,
        "--max-tokens",
        "4",
        "--ignore-eos",
    ]
    keyed = subprocess.run(
        [*bin_client, "--client-key", keys["bob"], "--server-key", keys["server"], "Hello"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert keyed.returncode == 0 and "4 completion tokens" in keyed.stderr, keyed.stderr
    keyless = subprocess.run([*bin_client, "Hello"], capture_output=True, text=True, timeout=60)
    assert keyless.returncode == 1 and "refused the connection" in keyless.stderr, keyless.stderr
    profile = [sys.executable, str(REPO / "bin" / "profile"), "--host", server.address, "--window", "5"]
    keyed = subprocess.run(
        [*profile, "--client-key", keys["alice"], "--server-key", keys["server"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert keyed.returncode == 0 and "worker" in keyed.stdout, keyed.stderr
    half = subprocess.run([*profile, "--client-key", keys["alice"]], capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "go together" in half.stderr, half.stderr
    assert "WARNING" not in server.output()  # loopback (ipc) and authenticated: nothing exposed
