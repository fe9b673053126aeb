"""A stand-in for the frontend's client socket, in a process a test can kill -9.

It binds the client socket exactly as the frontend does (:func:`conveyor.ipc.transport.bind_client_socket`:
limits, heartbeats, handover, ``--auth-keys``) and answers in the client protocol without a
model, so the clients' connection handling (auth, liveness, limits) is tested in a second
or two instead of a bin/serve start-up. Each ``generate`` gets one ``delta`` at once; with
``--answer`` its ``final`` follows (naming the connection's User-Id in ``text`` when
authenticated), otherwise the request stays in flight until the process dies.
Run: ``python -m tests.reliability.fake_server ADDRESS [--auth-keys DIR] [--answer]``;
it prints ``ready`` once bound.
"""

from __future__ import annotations

import argparse
import sys

import msgpack
import zmq

from conveyor.ipc import transport
from conveyor.protocol import limits


def user_id(frame: zmq.Frame) -> str:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # no authentication: no User-Id property
        return ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--auth-keys")
    p.add_argument("--answer", action="store_true")
    args = p.parse_args()
    ctx = zmq.Context()
    sock, _ = transport.bind_client_socket(
        ctx, args.address, max_message_bytes=limits.MAX_CLIENT_MESSAGE_BYTES, auth_keys=args.auth_keys
    )
    print("ready", flush=True)
    while True:
        identity, payload = sock.recv_multipart(copy=False)
        msg = msgpack.unpackb(payload.bytes)
        if msg.get("type") != "generate":
            continue
        rid = msg["request_id"]
        reply = {"type": "delta", "request_id": rid, "text": "x", "token_ids": [1]}
        sock.send_multipart([identity, msgpack.packb(reply)])
        if args.answer:
            final = {
                "type": "final",
                "request_id": rid,
                "text": user_id(payload),
                "token_ids": [1],
                "finish_reason": "stop",
                "error": None,
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0},
                "timing": {},
            }
            sock.send_multipart([identity, msgpack.packb(final)])


if __name__ == "__main__":
    sys.exit(main())
