"""What clients written for vLLM probe, against bin/serve --http-port: unknown request fields
accepted and reported (a warning once per name, the ``x-conveyor-ignored-fields`` header),
or refused with ``--strict-fields``; ``x-request-id`` echoed on every response and used as
the response's id when safe; ``GET /tokenizer_info`` in vLLM's shape, against transformers'
view of the same tokenizer; ``/v1/completions`` with a list of token-id lists."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import transformers

from tests.http.conftest import SERVE_ARGS


def call(
    url: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def model(url: str) -> str:
    return json.loads(call(url, "/v1/models")[2])["data"][0]["id"]


def test_unknown_fields_are_ignored_reported_and_warned_once(http_server) -> None:
    url, name = http_server.url, model(http_server.url)
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "xyz_knob": 3}
    for _ in range(2):
        status, headers, raw = call(url, "/v1/chat/completions", chat)
        assert status == 200 and headers["x-conveyor-ignored-fields"] == "xyz_knob", raw
    status, headers, _ = call(
        url, "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 2, "xyz_knob": 1, "user": "u"}
    )
    assert status == 200 and headers["x-conveyor-ignored-fields"] == "user,xyz_knob"
    # A field of the other endpoint is a mistake, not a foreign server's field: still a 400.
    status, _, raw = call(url, "/v1/completions", {"model": name, "prompt": "a", "messages": []})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
    deadline = time.monotonic() + 5
    while "'xyz_knob'" not in http_server.serve.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    warnings = [line for line in http_server.serve.output().splitlines() if "WARNING" in line and "'xyz_knob'" in line]
    assert len(warnings) == 1 and "--strict-fields" in warnings[0], warnings


def test_strict_fields_refuses_unknown_fields(http_factory, tiny_checkpoint) -> None:
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--strict-fields")
    name = model(server.url)
    status, _, raw = call(server.url, "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 2, "xyz_knob": 1})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "xyz_knob" and "--strict-fields" in error["message"]
    status, _, raw = call(
        server.url,
        "/v1/messages",
        {"model": name, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "xyz": 1},
    )
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    assert call(server.url, "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 2, "user": "u"})[0] == 200


def test_x_request_id_is_echoed_and_used_when_safe(http_server) -> None:
    url, name = http_server.url, model(http_server.url)
    body = {"model": name, "prompt": "a", "max_tokens": 2}
    status, headers, raw = call(url, "/v1/completions", body, {"X-Request-Id": "trace-42.a:b"})
    assert status == 200 and headers["x-request-id"] == "trace-42.a:b" and json.loads(raw)["id"] == "cmpl-trace-42.a:b"
    status, headers, raw = call(
        url,
        "/v1/chat/completions",
        {"model": name, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stream": True},
        {"X-Request-Id": "s-1"},
    )
    assert status == 200 and headers["x-request-id"] == "s-1" and b'"id":"chatcmpl-s-1"' in raw
    status, headers, raw = call(
        url,
        "/v1/messages",
        {"model": name, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
        {"X-Request-Id": "m-1"},
    )
    assert status == 200 and headers["x-request-id"] == "m-1" and json.loads(raw)["id"] == "msg_m-1"
    unsafe = 'a "quoted" id'
    status, headers, raw = call(url, "/v1/completions", body, {"X-Request-Id": unsafe})
    assert (
        status == 200
        and headers["x-request-id"] == unsafe
        and re.fullmatch(r"cmpl-[0-9a-f]{32}", json.loads(raw)["id"])
    )
    status, headers, raw = call(url, "/v1/completions", body)  # none given: a new one, sent back
    assert (
        re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
        and json.loads(raw)["id"] == "cmpl-" + headers["x-request-id"]
    )
    for path, payload in (("/v1/nope", {}), ("/v1/completions", {"model": "nope", "prompt": "a"}), ("/health", None)):
        assert call(url, path, payload, {"X-Request-Id": "e-7"})[1]["x-request-id"] == "e-7"


def test_tokenizer_info_matches_transformers(http_server, tiny_checkpoint) -> None:
    status, _, raw = call(http_server.url, "/tokenizer_info")
    info = json.loads(raw)
    reference = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert status == 200 and info["tokenizer_class"] and "vocab_file" not in info and "merges_file" not in info
    assert info["chat_template"] == reference.chat_template
    assert (info["eos_token"], info["eos_token_id"], info["bos_token_id"]) == (
        reference.eos_token,
        reference.eos_token_id,
        reference.bos_token_id,
    )
    assert info["vocab_size"] == len(reference)
    for token_id, text in info.get("added_tokens_decoder", {}).items():
        assert reference.convert_ids_to_tokens(int(token_id)) == text


def test_completions_take_a_list_of_token_id_lists(http_server) -> None:
    url, name = http_server.url, model(http_server.url)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"model": name, "prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, _, raw = call(url, "/v1/completions", body)
    reply = json.loads(raw)
    assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1]
    singles = [
        json.loads(call(url, "/v1/completions", {**body, "prompt": p})[2])["choices"][0]["text"] for p in prompts
    ]
    assert [c["text"] for c in reply["choices"]] == singles
    assert reply["usage"]["prompt_tokens"] == sum(map(len, prompts)) and reply["usage"]["completion_tokens"] == 8
    status, _, raw = call(url, "/v1/completions", {**body, "prompt": [[5, 6], []]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
