"""/v1/load_lora_adapter and /v1/unload_lora_adapter take vLLM's request bodies
(LoadLoRAAdapterRequest ``lora_name``, ``lora_path``, ``load_inplace``; UnloadLoRAAdapterRequest
``lora_name``, ``lora_int_id``), each field type-checked, and map the frontend's refusals onto
statuses. The app runs on aiohttp's test server against a stand-in frontend link that records
what it was asked (the full server path: test_lora_http.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from conveyor.client import ServerError
from conveyor.http.app import api_app


class FakeLoraClient:
    def __init__(self, refusal: ServerError | None) -> None:
        self.calls: list[tuple] = []
        self.refusal = refusal

    async def load_lora(self, name: str, path: str) -> dict:
        self.calls.append(("load", name, path))
        if self.refusal is not None:
            raise self.refusal
        return {}

    async def unload_lora(self, name: str) -> dict:
        self.calls.append(("unload", name))
        if self.refusal is not None:
            raise self.refusal
        return {}


class FakeLink:
    """What the adapter routes use of :class:`~conveyor.http.link.FrontendLink`."""

    def __init__(self, refusal: ServerError | None = None) -> None:
        self.client = FakeLoraClient(refusal)
        self.started = True

    async def require_started(self) -> None:
        pass

    async def stats(self, timeout: float) -> dict:
        return {"lora_adapters": []}

    async def close(self) -> None:
        pass


def post(path: str, body, refusal: ServerError | None = None) -> tuple[int, object, list[tuple]]:
    """POST ``body`` as JSON; (status, the body: text on success, the error object otherwise,
    what the link was asked)."""
    link = FakeLink(refusal)

    async def main():
        client = TestClient(TestServer(api_app(link, "tiny", 256, 0)))
        await client.start_server()
        try:
            response = await client.post(path, json=body)
            text = await response.text()
            return response.status, (text if response.status == 200 else (await response.json())["error"])
        finally:
            await client.close()

    status, reply = asyncio.run(main())
    return status, reply, link.client.calls


LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def test_vllm_bodies_are_taken_and_lora_int_id_is_ignored() -> None:
    assert post(UNLOAD, {"lora_name": "sql", "lora_int_id": 3}) == (
        200,
        "Success: LoRA adapter 'sql' unloaded.",
        [("unload", "sql")],
    )
    assert post(UNLOAD, {"lora_name": "sql", "lora_int_id": None})[2] == [("unload", "sql")]
    assert post(LOAD, {"lora_name": "sql", "lora_path": "/a/sql", "load_inplace": False}) == (
        200,
        "Success: LoRA adapter 'sql' loaded from /a/sql.",
        [("load", "sql", "/a/sql")],
    )
    assert post(LOAD, {"lora_name": "sql", "lora_path": "/a/sql", "load_inplace": True})[:2] == (
        200,
        "Success: LoRA adapter 'sql' loaded from /a/sql.",
    )  # a new name: loaded as vLLM does


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        (UNLOAD, {"lora_name": "sql", "lora_int_id": "3"}, "lora_int_id", "'lora_int_id' must be an integer or null"),
        (UNLOAD, {"lora_name": "sql", "lora_int_id": True}, "lora_int_id", "must be an integer or null"),
        (UNLOAD, {"lora_name": "sql", "lora_int_id": 1.5}, "lora_int_id", "must be an integer or null"),
        (UNLOAD, {"lora_int_id": 3}, "lora_name", "'lora_name' is required"),
        (UNLOAD, {"lora_name": "", "lora_int_id": 3}, "lora_name", "'lora_name' must be a non-empty string"),
        (UNLOAD, {"lora_name": "sql", "lora_path": "/a"}, "lora_path", "unrecognized field(s): 'lora_path'"),
        (LOAD, {"lora_name": "sql"}, "lora_path", "'lora_path' is required"),
        (LOAD, {"lora_name": 7, "lora_path": "/a"}, "lora_name", "'lora_name' must be a non-empty string"),
        (LOAD, {"lora_name": "sql", "lora_path": "/a", "load_inplace": "yes"}, "load_inplace", "must be a boolean"),
        (LOAD, {"lora_name": "sql", "lora_path": "/a", "load_inplace": None}, "load_inplace", "must be a boolean"),
        (LOAD, {"lora_name": "sql", "lora_path": "/a", "lora_int_id": 1}, "lora_int_id", "unrecognized field(s)"),
        (LOAD, {"lora_name": "tiny", "lora_path": "/a"}, "lora_name", "the served model's name"),
        (LOAD, ["sql"], None, "must be a JSON object"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(path, body, param, says) -> None:
    status, error, calls = post(path, body)
    assert status == 400 and error["param"] == param and says in error["message"], error
    assert calls == []


@pytest.mark.parametrize(
    "code, status",
    [
        ("lora_already_loaded", 400),
        ("invalid_lora", 400),
        ("lora_not_found", 404),
        ("lora_loading_disabled", 404),
        ("lora_in_use", 409),
        ("lora_update_pending", 409),
        ("timeout", 504),
        ("server_error", 500),
    ],
)
def test_refusals_get_their_status(code, status) -> None:
    got, error, _ = post(LOAD, {"lora_name": "sql", "lora_path": "/a"}, ServerError("why", code))
    assert got == status and "why" in error["message"], error
    assert error["code"] == ("internal_error" if code == "server_error" else code)


def test_load_inplace_on_a_loaded_name_says_it_is_not_replaced() -> None:
    status, error, _ = post(
        LOAD,
        {"lora_name": "sql", "lora_path": "/b", "load_inplace": True},
        ServerError("LoRA adapter 'sql' is already loaded", "lora_already_loaded"),
    )
    assert status == 400 and error["code"] == "lora_already_loaded"
    assert "does not replace a loaded adapter's weights in place" in error["message"]
