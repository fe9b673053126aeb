"""bin/serve --lora-modules: the OpenAI ``model`` field picks an adapter (listed by
/v1/models), greedy tokens equal HF transformers with PEFT, an unknown model is a 404 over
HTTP, and an unknown adapter an error over ZeroMQ."""

from __future__ import annotations

import torch

from conveyor.client import Client
from tests.http.conftest import SERVE_ARGS
from tests.http.test_raw_http import assert_error, request
from tests.lora_adapters import make_adapter


def test_model_field_selects_the_adapter(http_factory, tiny_checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    peft = make_adapter(base, tmp_path / "sql", seed=3, rank=16)
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0",
                          "--lora-modules", f"sql={tmp_path / 'sql'}", "--max-loras", "1")
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
            want = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                      do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert got[model] == want, model
    assert got["sql"] != got[names[0]]
    assert_error(request(server, "POST", "/v1/completions", {**body, "model": "nope"}), 404, "model", "model_not_found")
    with Client(server.address) as client:
        assert client.generate(token_ids=prompt, max_tokens=8, temperature=0, ignore_eos=True, lora="sql").token_ids \
            == got["sql"]
        failed = client.generate(token_ids=prompt, max_tokens=2, lora="nope")
        assert failed.finish_reason == "error" and "unknown LoRA adapter 'nope'" in failed.error
