"""The HTTP process without a server behind it: what it answers while the rest is starting
(or gone), and that it never imports torch. No bin/serve, no torch (runs in the no-torch venv)."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from conveyor.http.app import api_app, metrics_app
from conveyor.http.link import FrontendLink
from tests.no_torch import run_without_torch


def run_app(tmp_path, scenario, make=api_app):
    """``scenario(client)`` against the app, its link pointed where no frontend listens."""

    async def main():
        link = FrontendLink(f"ipc://{tmp_path}/nobody.sock")
        client = TestClient(TestServer(make(link, "tiny", 256, 0)))
        await client.start_server()
        try:
            return await scenario(client)
        finally:
            await client.close()
            await link.close()

    return asyncio.run(main())


def test_while_starting_generation_and_health_are_503_and_bad_bodies_still_400(tmp_path) -> None:
    async def scenario(client):
        health = await client.get("/health")
        gen = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        bad = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": [3]})
        models = await client.get("/v1/models")
        return (health.status, await health.json()), (gen.status, await gen.json()), bad.status, await models.json()

    (health, health_body), (gen, gen_body), bad, models = run_app(tmp_path, scenario)
    assert health == 503 and health_body["error"]["code"] == "unhealthy"
    assert (
        gen == 503
        and gen_body["error"]["code"] == "starting"
        and gen_body["error"]["type"] == "service_unavailable_error"
    )
    assert bad == 400
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256


def test_the_metrics_listener_serves_only_metrics_and_health(tmp_path) -> None:
    async def scenario(client):
        gen = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        health = await client.get("/health")
        return gen.status, (await gen.json())["error"]["code"], health.status

    assert run_app(tmp_path, scenario, metrics_app) == (404, "not_found", 503)


def test_the_http_process_never_needs_torch() -> None:
    run_without_torch("import conveyor.http.main  # the whole HTTP process\n")
