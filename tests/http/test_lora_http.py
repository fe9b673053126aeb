"""bin/serve --lora-modules: the OpenAI ``model`` field picks an adapter (listed by
/v1/models), greedy tokens equal HF transformers with PEFT, an unknown model is a 404 over
HTTP, and an unknown adapter an error over ZeroMQ. With --enable-lora-loading, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter change them while it serves, answered with
vLLM's statuses, and adapters loaded or unloaded over ZeroMQ are seen over HTTP too."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import torch

from conveyor.client import Client
from tests.e2e.test_lora_live import greedy
from tests.http.conftest import SERVE_ARGS
from tests.http.test_raw_http import assert_error, request
from tests.lora_adapters import make_adapter


def post(server, path: str, body: dict) -> tuple[int, str]:
    """POST a JSON body; the status and the body as text (a success is plain text, as vLLM's)."""

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + path, data=json.dumps(body).encode()) as response:
                return response.status, await response.text()

    return asyncio.run(go())


def error_of(reply: tuple[int, str], status: int, code: str) -> str:
    got, text = reply
    error = json.loads(text)["error"]
    assert got == status and error["code"] == code, (got, error)
    return error["message"]


def test_model_field_selects_the_adapter(http_factory, tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    peft = make_adapter(base, tmp_path / "sql", seed=3, rank=16)
    server = http_factory(
        "--model",
        str(tiny_checkpoint),
        *SERVE_ARGS,
        "--http-port",
        "0",
        "--lora-modules",
        f"sql={tmp_path / 'sql'}",
        "--max-loras",
        "1",
    )
    status, listed = request(server, "GET", "/v1/models")
    names = [card["id"] for card in listed["data"]]
    assert status == 200 and names == [tiny_checkpoint.name, "sql"] and listed["data"][1]["parent"] == names[0]
    prompt = [5, 17, 29, 41, 53, 65, 77, 89, 101]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    got = {}
    for model in names:
        status, reply = request(server, "POST", "/v1/completions", {**body, "model": model})
        assert status == 200 and reply["model"] == model, reply
        got[model] = reply["choices"][0]["token_ids"]
    for model, reference in ((names[0], base), ("sql", peft)):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            want = reference.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert got[model] == want, model
    assert got["sql"] != got[names[0]]
    assert_error(request(server, "POST", "/v1/completions", {**body, "model": "nope"}), 404, "model", "model_not_found")
    load = {"lora_name": "more", "lora_path": str(tmp_path / "sql")}
    assert "--enable-lora-loading" in error_of(
        post(server, "/v1/load_lora_adapter", load), 404, "lora_loading_disabled"
    )
    with Client(server.address) as client:
        assert (
            client.generate(token_ids=prompt, max_tokens=8, temperature=0, ignore_eos=True, lora="sql").token_ids
            == got["sql"]
        )
        failed = client.generate(token_ids=prompt, max_tokens=2, lora="nope")
        assert failed.finish_reason == "error" and "unknown LoRA adapter 'nope'" in failed.error


def test_load_and_unload_while_serving(http_factory, tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    sql = make_adapter(base, tmp_path / "sql", seed=8, rank=8)
    chat = make_adapter(base, tmp_path / "chat", seed=9, rank=4, targets=["o_proj", "up_proj"])
    make_adapter(base, tmp_path / "wide", seed=10, rank=32)
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--enable-lora-loading")
    prompt = [7, 19, 31, 43, 55, 67, 79]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def tokens(model: str) -> list[int]:
        status, reply = request(server, "POST", "/v1/completions", {**body, "model": model})
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    def listed() -> list[str]:
        return [card["id"] for card in request(server, "GET", "/v1/models")[1]["data"][1:]]

    assert post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}) == (
        200,
        f"Success: LoRA adapter 'sql' loaded from {tmp_path / 'sql'}.",
    )
    assert listed() == ["sql"] and tokens("sql") == greedy(sql, prompt, 8) != greedy(base, prompt, 8)
    load = "/v1/load_lora_adapter"
    assert "is already loaded" in error_of(
        post(server, load, {"lora_name": "sql", "lora_path": str(tmp_path / "chat")}), 400, "lora_already_loaded"
    )
    assert "missing file" in error_of(
        post(server, load, {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}), 404, "lora_not_found"
    )
    assert "rank 32" in error_of(
        post(server, load, {"lora_name": "x", "lora_path": str(tmp_path / "wide")}), 400, "invalid_lora"
    )
    assert_error(request(server, "POST", load, {"lora_name": "x"}), 400, "lora_path")
    assert "no LoRA adapter 'x' is loaded" in error_of(
        post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}), 404, "lora_not_found"
    )
    assert listed() == ["sql"]

    with Client(server.address) as client:
        client.load_lora("chat", tmp_path / "chat")  # over ZeroMQ: HTTP asks for the names again on a miss
        assert tokens("chat") == greedy(chat, prompt, 8)
        client.unload_lora("sql")  # HTTP still lists it until it asks: the scheduler's refusal is the 404
        assert_error(
            request(server, "POST", "/v1/completions", {**body, "model": "sql"}), 404, "model", "model_not_found"
        )
        stream = client.stream(token_ids=prompt, max_tokens=100, temperature=0, ignore_eos=True, lora="chat")
        assert next(stream).finish_reason is None
        assert "in use" in error_of(post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"}), 409, "lora_in_use")
        assert [delta.finish_reason for delta in stream][-1] == "length"
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "chat", "lora_int_id": 2}) == (
            200,
            "Success: LoRA adapter 'chat' unloaded.",
        )  # vLLM's id: taken, ignored (names only)
        assert listed() == []
        assert_error(
            request(server, "POST", "/v1/completions", {**body, "model": "chat"}), 404, "model", "model_not_found"
        )
        assert client.stats()["held_blocks"] == 0
