"""bin/keygen: make the CurveZMQ keys of ``bin/serve --auth-keys DIR``.

``bin/keygen DIR`` makes the server's key pair (DIR/server.key, DIR/server.key_secret) and
the directory of allowed clients (DIR/clients/); ``bin/keygen DIR --client NAME`` adds a
client (making the server's pair first if DIR has none): DIR/clients/NAME.key (its public
key, which the server allows) and DIR/clients/NAME.key_secret (its key pair, to hand to that
client with DIR/server.key); ``bin/keygen DIR --cluster`` makes the key pair every node of a
multi-node server holds (DIR/cluster.key_secret, for ``bin/serve --cluster-key``). The
layout is :mod:`conveyor.ipc.transport`'s. Keys are never overwritten: a server key pair
that already exists is kept (its clients keep working), and a client name in use is an
error. Secret files are mode 0600, DIR/clients 0700.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import zmq.auth

from conveyor.ipc import transport

_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def make_server_keys(keys_dir: str) -> bool:
    """The server's key pair and the clients directory under ``keys_dir``; False if the pair
    was there already (kept as it is)."""
    os.makedirs(transport.client_keys_dir(keys_dir), mode=0o700, exist_ok=True)
    if os.path.exists(transport.server_secret_key_file(keys_dir)):
        return False
    _create(keys_dir, transport.SERVER_KEY_NAME)
    return True


def make_client_keys(keys_dir: str, name: str) -> str:
    """A new allowed client ``name``: its public key in DIR/clients; returns its secret file."""
    if not _CLIENT_NAME.fullmatch(name):
        raise ValueError(f"client name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    clients = transport.client_keys_dir(keys_dir)
    if not os.path.isdir(clients):
        raise ValueError(f"{keys_dir} has no server keys yet: run bin/keygen {keys_dir} first")
    if os.path.exists(os.path.join(clients, f"{name}.key")):
        raise ValueError(f"client {name!r} exists already in {clients}")
    return _create(clients, name)


def make_cluster_key(keys_dir: str) -> str:
    """The key pair of a multi-node server (``bin/serve --cluster-key``), DIR/cluster.key_secret;
    returns it. Kept if there already: every node must hold the same one."""
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    secret = os.path.join(keys_dir, f"{transport.CLUSTER_KEY_NAME}.key_secret")
    return secret if os.path.exists(secret) else _create(keys_dir, transport.CLUSTER_KEY_NAME)


def _create(directory: str, name: str) -> str:
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return secret


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="keygen", description="Make the CurveZMQ keys for bin/serve --auth-keys DIR.")
    p.add_argument("dir", help="key directory (made if missing)")
    p.add_argument("--client", metavar="NAME", help="add an allowed client NAME (and the server keys, if DIR has none)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="make DIR/cluster.key_secret, the key pair of bin/serve --nnodes > 1 --cluster-key",
    )
    args = p.parse_args(argv)
    try:
        if args.cluster:
            secret = make_cluster_key(args.dir)
            print(f"cluster key pair: {secret}; copy it to every node (bin/serve --cluster-key {secret})")
            return 0
        made = make_server_keys(args.dir)
        if made or args.client is None:
            print(
                f"server key pair {'made' if made else 'kept (already there)'}: "
                f"{transport.server_secret_key_file(args.dir)}"
            )
        if args.client is None:
            print(
                f"clients need {transport.server_public_key_file(args.dir)}; add one with: bin/keygen {args.dir} "
                "--client NAME"
            )
        else:
            secret = make_client_keys(args.dir, args.client)
            print(f"client {args.client}: give {secret} and {transport.server_public_key_file(args.dir)} to it")
            print(f"  (bin/client --client-key {secret} --server-key {transport.server_public_key_file(args.dir)})")
    except (OSError, ValueError) as exc:
        print(f"keygen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
