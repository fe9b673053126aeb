"""What an RL trainer drives a running bin/serve with (issue 42; docs/rl.md), over HTTP and
ZeroMQ, on one server of two tensor-parallel ranks (gloo) shared by the module: an update from
a checkpoint directory serves HF transformers' greedy tokens of the new weights while the
request in flight finishes on the old ones (each reporting its weight version), a bad update
is refused whole; an update the trainer's rank 0 broadcasts into a torch.distributed group
(both ranks members) equals HF with the new weights; sleep level 2 holds a request until the
wake, which serves the served checkpoint's weights again; pause keeps a stream in place until
resume, or aborts it with the reason."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.client import Client, ServerError
from conveyor.client.commands import weight_group
from tests.checkpoints import randomize
from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import http_serve, stop_and_check
from tests.trainer_group import trainer_broadcasting

PROMPT = [5, 9, 33, 120, 7, 64, 200, 18]
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)
SERVE_ARGS = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--block-size", "8", "--threads", "1")
SERVE_ARGS += ("--distributed-timeout", "60", "--enable-rl-control", "--no-profile")


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint after a "training step": the same model with other weights."""
    directory = tmp_path_factory.mktemp("trained")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    randomize(model, seed=7)
    model.save_pretrained(directory)
    for file in tiny_checkpoint.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    serve = ServeProcess(
        ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0"], tmp_path_factory.mktemp("rl")
    )
    http = http_serve(serve)
    yield http
    stop_and_check(http)


def hf_greedy(directory, n: int = 8) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def http(server, method: str, path: str, body=None) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as session:
            data = None if body is None else json.dumps(body).encode()
            async with session.request(method, server.url + path, data=data) as response:
                return response.status, await response.json(content_type=None)

    return asyncio.run(go())


def test_an_update_from_disk_serves_the_new_weights(server, tiny_checkpoint, trained) -> None:
    with Client(server.address) as client, Client(server.address) as other:
        first = client.generate(token_ids=PROMPT, **GREEDY)
        assert first.token_ids == hf_greedy(tiny_checkpoint) and first.weight_version == 0
        stream = other.stream(token_ids=PROMPT, max_tokens=60, temperature=0, ignore_eos=True)
        streamed = list(next(stream).token_ids)
        status, body = http(server, "POST", "/update_weights_from_disk", {"model_path": str(trained)})
        assert status == 200 and body["success"] and body["weight_version"] == 1, body
        for delta in stream:  # it finished, on the old weights, before the update
            streamed += delta.token_ids
        assert delta.result.weight_version == 0 and streamed == hf_greedy(tiny_checkpoint, 60)
        after = client.generate(token_ids=PROMPT, **GREEDY)
        assert after.token_ids == hf_greedy(trained) and after.weight_version == 1
        status, body = http(server, "POST", "/update_weights_from_disk", {"model_path": str(trained / "nowhere")})
        assert status == 404 and body["error"]["code"] == "weights_not_found", body
        with pytest.raises(ServerError) as refused:
            client.update_weights(tiny_checkpoint / "tokenizer.json")
        assert refused.value.code in ("weights_not_found", "invalid_weights")
        assert client.generate(token_ids=PROMPT, **GREEDY).token_ids == hf_greedy(trained)  # refused whole
        assert http(server, "GET", "/get_weight_version") == (200, {"weight_version": 1})


def test_an_update_from_the_trainers_group_at_two_ranks(server, tiny_checkpoint) -> None:
    """The trainer (rank 0 of a world of 3) broadcasts the original weights; both server ranks
    receive every tensor and load their shards."""
    tensors = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).state_dict()
    with trainer_broadcasting(tensors, 3) as (address, specs):
        body = {
            "master_address": "127.0.0.1",
            "master_port": int(address.rsplit(":", 1)[1]),
            "rank_offset": 1,
            "world_size": 3,
            "names": [name for name, _, _ in specs],
            "dtypes": [str(dtype).removeprefix("torch.") for _, dtype, _ in specs],
            "shapes": [list(shape) for _, _, shape in specs],
            "timeout_s": 60,
        }
        status, reply = http(server, "POST", "/update_weights_from_distributed", body)
    assert status == 200 and reply["weight_version"] == 2, reply
    with Client(server.address) as client:
        result = client.generate(token_ids=PROMPT, **GREEDY)
        assert result.token_ids == hf_greedy(tiny_checkpoint) and result.weight_version == 2


def test_sleep_level_2_holds_requests_until_wake(server, tiny_checkpoint, trained) -> None:
    with Client(server.address) as client:
        client.update_weights(trained)
        version = client.engine_state()["weight_version"]
        status, body = http(server, "POST", "/sleep?level=2")
        assert status == 200 and body["is_sleeping"] and body["sleep_level"] == 2 and body["freed_bytes"] > 0, body
        assert http(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        assert http(server, "POST", "/update_weights_from_disk", {"model_path": str(trained)})[0] == 409
        group = weight_group("127.0.0.1:1", 1, 3, [("model.norm.weight", "float32", [64])])
        with pytest.raises(ServerError, match="wake_up first") as refused:
            client.update_weights(group=group)
        assert refused.value.code == "invalid_control"
        held: list = []
        waiter = threading.Thread(
            target=lambda: held.append(Client(server.address).generate(token_ids=PROMPT, **GREEDY))
        )
        waiter.start()
        time.sleep(0.5)
        assert not held  # waits for the wake
        status, body = http(server, "POST", "/wake_up")
        assert status == 200 and not body["is_sleeping"], body
        waiter.join(30)
        # Level 2 read the served checkpoint again: its weights, a new version.
        assert held[0].token_ids == hf_greedy(tiny_checkpoint) and held[0].weight_version == version + 1
        assert http(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert client.sleep(1)["sleep_level"] == 1 and not client.wake_up()["is_sleeping"]  # (over ZeroMQ)
        assert client.generate(token_ids=PROMPT, **GREEDY).token_ids == hf_greedy(tiny_checkpoint)


def test_pause_keeps_or_aborts_what_runs(server, tiny_checkpoint) -> None:
    with Client(server.address) as client, Client(server.address) as other:
        stream = other.stream(token_ids=PROMPT, max_tokens=60, temperature=0, ignore_eos=True)
        streamed = list(next(stream).token_ids)
        assert http(server, "POST", "/pause?mode=keep")[0] == 200
        assert http(server, "GET", "/is_paused") == (200, {"is_paused": True})
        running = client.stats()["num_running"]
        time.sleep(0.3)
        assert client.stats()["num_running"] == running == 1  # kept in place, not stepping
        assert http(server, "POST", "/resume")[0] == 200
        for delta in stream:
            streamed += delta.token_ids
        assert streamed == hf_greedy(tiny_checkpoint, 60)
        stream = other.stream(token_ids=PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
        next(stream)
        reply = client.pause("abort")
        assert reply["is_paused"]
        last = list(stream)[-1]
        assert last.finish_reason == "abort" and "generation paused" in (last.result.error or "")
        assert http(server, "POST", "/continue_generation")[0] == 200
        assert client.generate(token_ids=PROMPT, **GREEDY).token_ids == hf_greedy(tiny_checkpoint)
