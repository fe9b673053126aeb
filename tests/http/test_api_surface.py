"""The OpenAI/vLLM API surface beyond generation, against one bin/serve --http-port with API
keys and TLS (a self-signed certificate made here): keys on every route that needs one,
/v1/models/{id}, /tokenize, /detokenize, /version, /invocations, and the request fields
the HTTP face implements (echo, return_token_ids, continuous usage, ignored fields listed,
chat to the context limit, any 64-bit seed), with the official openai client and raw HTTP."""

from __future__ import annotations

import datetime
import json
import ssl
import urllib.error
import urllib.request

import openai
import pytest
import transformers

from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import SERVE_ARGS, http_serve, stop_and_check

KEYS = ("key-one", "key-two")
MAX_MODEL_LEN = 48
EXTRA = {"ignore_eos": True}


def _self_signed(directory) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(certfile), str(keyfile)


@pytest.fixture(scope="module")
def secure(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    certfile, keyfile = _self_signed(directory)
    keyfile_list = directory / "keys.txt"
    keyfile_list.write_text(f"# clients\n{KEYS[1]}\n\n")
    args = [
        "--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--max-model-len", str(MAX_MODEL_LEN),
        "--api-key", KEYS[0], "--api-key-file", str(keyfile_list), "--ssl-certfile", certfile, "--ssl-keyfile", keyfile,
    ]  # fmt: skip
    server = http_serve(ServeProcess(args, directory))
    server.certfile = certfile
    yield server
    stop_and_check(server)


def call(server, method: str, path: str, body=None, key: str | None = KEYS[0]) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one HTTPS request, the server's certificate trusted."""
    context = ssl.create_default_context(cafile=server.certfile)
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, context=context, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null"), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def client(server, key: str = KEYS[0]) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=server.certfile))
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, http_client=http)


def test_keys_guard_every_api_route_and_leave_health_open(secure, tiny_checkpoint) -> None:
    assert secure.url.startswith("https://")
    model = tiny_checkpoint.name
    guarded = [
        ("GET", "/v1/models", None), ("GET", f"/v1/models/{model}", None),
        ("POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
        ("POST", "/invocations", {"model": model, "prompt": "hi", "max_tokens": 2}),
    ]  # fmt: skip
    for method, path, body in guarded:
        for key in (None, "wrong", KEYS[0] + "x", KEYS[0][:-1]):
            status, reply, _ = call(secure, method, path, body, key)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", (path, key, reply)
        for key in KEYS:  # a key given by flag and one from the file
            status, reply, _ = call(secure, method, path, body, key)
            assert status == 200, (path, reply)
    for path in ("/health", "/version", "/metrics"):
        req = urllib.request.Request(secure.url + path)
        with urllib.request.urlopen(
            req, context=ssl.create_default_context(cafile=secure.certfile), timeout=30
        ) as response:
            assert response.status == 200
    with pytest.raises(openai.AuthenticationError):
        client(secure, "nope").models.list()
    assert [m.id for m in client(secure, KEYS[1]).models.list().data] == [model]


def test_models_retrieve_version_tokenize_detokenize(secure, tiny_checkpoint) -> None:
    model = tiny_checkpoint.name
    card = client(secure).models.retrieve(model)
    assert card.id == model and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client(secure).models.retrieve("other")
    status, body, _ = call(secure, "GET", "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    from conveyor import __version__

    assert call(secure, "GET", "/version")[1] == {"version": __version__}
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    status, body, _ = call(secure, "POST", "/tokenize", {"model": model, "prompt": "The quick brown fox"})
    assert status == 200 and body["tokens"] == hf.encode("The quick brown fox") and body["count"] == len(body["tokens"])
    assert call(secure, "POST", "/tokenize", {"prompt": "The fox", "add_special_tokens": False})[1][
        "tokens"
    ] == hf.encode("The fox", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello there"}]
    status, body, _ = call(secure, "POST", "/tokenize", {"messages": messages})
    assert body["tokens"] == list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    ids = hf.encode("Hello world, again")
    assert call(secure, "POST", "/detokenize", {"tokens": ids})[1] == {"prompt": hf.decode(ids)}
    status, body, _ = call(secure, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and body["error"]["param"] == "tokens"


def test_invocations_route_by_body_shape(secure, tiny_checkpoint) -> None:
    model = tiny_checkpoint.name
    base = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = call(secure, "POST", "/invocations", {**base, "prompt": "The quick"})[1]
    assert completion["object"] == "text_completion"
    assert (
        completion["choices"][0]["text"]
        == call(secure, "POST", "/v1/completions", {**base, "prompt": "The quick"})[1]["choices"][0]["text"]
    )
    chat = call(secure, "POST", "/invocations", {**base, "messages": [{"role": "user", "content": "hi"}]})[1]
    assert chat["object"] == "chat.completion"
    status, body, _ = call(secure, "POST", "/invocations", {"model": model})
    assert status == 400


def test_echo_token_ids_ignored_fields_and_seeds(secure, tiny_checkpoint) -> None:
    model = tiny_checkpoint.name
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    base = {"model": model, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = call(secure, "POST", "/v1/completions", {**base, "prompt": "The quick"})[1]["choices"][0]
    status, body, headers = call(
        secure, "POST", "/v1/completions",
        {**base, "prompt": "The quick", "echo": True, "return_token_ids": True, "user": "me", "cache_salt": "x"},
    )  # fmt: skip
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == "The quick" + plain["text"]
    assert choice["prompt_token_ids"] == hf.encode("The quick") and len(choice["token_ids"]) == 5
    assert hf.decode(choice["token_ids"]) == plain["text"]
    assert headers["x-conveyor-ignored-fields"] == "cache_salt,user"
    ids = hf.encode("Once upon")
    echoed = call(secure, "POST", "/v1/completions", {**base, "prompt": ids, "echo": True})[1]["choices"][0]["text"]
    assert echoed.startswith(hf.decode(ids))
    sampled = {**base, "temperature": 1.0, "prompt": "The quick"}
    for seed in (-1, -(2**63), 2**64 - 1, 12345678901234567890):
        a = call(secure, "POST", "/v1/completions", {**sampled, "seed": seed})[1]["choices"][0]["text"]
        b = call(secure, "POST", "/v1/completions", {**sampled, "seed": seed})[1]["choices"][0]["text"]
        assert a == b, seed
    # -1 and 2**64 - 1 have one bit pattern, so one stream
    assert (
        call(secure, "POST", "/v1/completions", {**sampled, "seed": -1})[1]["choices"][0]["text"]
        == call(secure, "POST", "/v1/completions", {**sampled, "seed": 2**64 - 1})[1]["choices"][0]["text"]
    )
    status, body, _ = call(secure, "POST", "/v1/completions", {**sampled, "seed": 2**64})
    assert status == 400 and body["error"]["param"] == "seed"


def test_chat_without_max_tokens_runs_to_the_context_limit(secure, tiny_checkpoint) -> None:
    messages = [{"role": "user", "content": "Count"}]
    result = client(secure).chat.completions.create(model=tiny_checkpoint.name, messages=messages, extra_body=EXTRA)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens + result.usage.completion_tokens == MAX_MODEL_LEN
    completion = client(secure).completions.create(model=tiny_checkpoint.name, prompt="Count", extra_body=EXTRA)
    assert completion.usage.completion_tokens == 16  # completions keep OpenAI's default of 16


def test_continuous_usage_stats_stream(secure, tiny_checkpoint) -> None:
    stream = client(secure).completions.create(
        model=tiny_checkpoint.name, prompt="The quick brown", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={**EXTRA,
                                                                                            "return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    prompt_tokens = chunks[-1].usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    ids = [t for c in chunks[:-1] for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert len(ids) == 6
    assert (
        chunks[0].choices[0].model_extra["prompt_token_ids"]
        and len(chunks[0].choices[0].model_extra["prompt_token_ids"]) == prompt_tokens
    )


DASHBOARD = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "grafana" / "conveyor.json"


def _queries(node) -> list[str]:
    """Every PromQL string of a Grafana dashboard: targets' ``expr`` and variables' queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, str) and "(" in value:
                found.append(value)
            else:
                found.extend(_queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_queries(item))
    return found


def test_every_dashboard_query_names_an_exported_series(secure, tiny_checkpoint) -> None:
    import re

    from prometheus_client.parser import text_string_to_metric_families

    call(secure, "POST", "/v1/completions", {"model": tiny_checkpoint.name, "prompt": "warm", "max_tokens": 2})
    context = ssl.create_default_context(cafile=secure.certfile)
    with urllib.request.urlopen(secure.url + "/metrics", context=context, timeout=30) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    exported = {s.name for f in families for s in f.samples}
    assert all(s.labels.get("model_name") == tiny_checkpoint.name for f in families for s in f.samples)
    queries = _queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 20
    named = set()
    for query in queries:
        names = set(re.findall(r"\b(?:conveyor|vllm):[A-Za-z0-9_:]+", query))
        assert names, query
        named |= names
    missing = sorted(named - exported)
    assert not missing, f"dashboard queries name series the server does not export: {missing}"
    # a vLLM dashboard's names are there too
    for name in (
        "vllm:num_requests_running",
        "vllm:gpu_cache_usage_perc",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:iteration_tokens_total_bucket",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:time_per_output_token_seconds_bucket",
    ):
        assert name in exported, name
