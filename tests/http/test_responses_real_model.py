"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) behind bin/serve --http-port, asked
through the official openai SDK's ``responses.create``: a greedy answer to a capital question
names the capital (tests/bench/test_eval.py holds the same answer equal to transformers')."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import http_serve, stop_and_check


def test_responses_create_answers_a_capital_question(tmp_path) -> None:
    from conveyor.checkpoints.gguf.default_model import FetchError, default_model_file

    try:
        default_model_file()
    except FetchError as exc:
        pytest.skip(f"the default model cannot be fetched here: {exc}")
    server = http_serve(ServeProcess(["--threads", "1", "--num-kv-blocks", "64", "--http-port", "0"], tmp_path))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=12, temperature=0)
        assert reply.status in ("completed", "incomplete") and reply.output[0].type == "message"
        assert "Paris" in reply.output_text, reply.output_text
    finally:
        stop_and_check(server)
