"""The generate fields the frontend applies itself (protocol.requests.FRONTEND_FIELDS), driven
over the client protocol against a live frontend and a stand-in scheduler (conftest.py:
``live_frontend``): what reaches the scheduler (the prompt's ids, ``max_tokens``, the seed)
and what the client gets back (the text), checked against transformers' tokenizer."""

from __future__ import annotations

import time

import pytest

from conveyor.ipc.messages import AddRequest, RequestOutput, TokenOutputs

CHAT = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn leaves fall"}]


_SOCKETS: list = []  # every test client stays open (a closed one would abort its requests)


def _add(fe, **fields) -> tuple[object, AddRequest]:
    sock = fe.client()
    _SOCKETS.append(sock)
    fe.send(sock, **{"type": "generate", "request_id": "r", **fields})
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest), add
    return sock, add


def _finish(fe, sock, add: AddRequest, tokens: list[int], reason: str = "length") -> dict:
    now = time.time()
    fe.scheduler_send(
        TokenOutputs([RequestOutput(add.request_id, tokens, reason, scheduled_time=now, first_token_time=now)])
    )
    return fe.until_final(sock)[-1]


def test_truncation_and_fill_context_shape_what_the_scheduler_gets(live_frontend, ours) -> None:
    fe = live_frontend(max_model_len=64)
    ids = ours["demo"].encode("the quick brown fox jumps over the lazy dog")
    assert len(ids) > 4
    _, add = _add(fe, prompt="the quick brown fox jumps over the lazy dog", truncate_prompt_tokens=4, fill_context=True)
    assert add.prompt_token_ids == ids[-4:]  # the newest tokens are kept
    assert add.sampling.max_tokens == 64 - 4  # the room the context leaves
    _, add = _add(fe, prompt="hello", fill_context=True, max_tokens=5, request_id="explicit")
    assert add.sampling.max_tokens == 5  # an explicit max_tokens wins
    _, add = _add(fe, prompt="hello", request_id="plain")
    assert add.sampling.max_tokens == 16  # the protocol's default without fill_context


@pytest.mark.parametrize(
    ("seed", "stored"), [(-1, -1), (-(2**63), -(2**63)), (2**64 - 1, -1), (2**63, -(2**63)), (7, 7)]
)
def test_any_64_bit_seed_reaches_the_sampler_as_its_bit_pattern(live_frontend, seed, stored) -> None:
    fe = live_frontend()
    _, add = _add(fe, prompt="hi", seed=seed)
    assert add.sampling.seed == stored


def test_chat_fields_render_as_transformers_does(live_frontend, ours, hf) -> None:
    fe = live_frontend()
    _, add = _add(fe, messages=CHAT, continue_final_message=True)
    expected = hf["demo"].apply_chat_template(
        CHAT, continue_final_message=True, add_generation_prompt=False, return_dict=False
    )
    assert add.prompt_token_ids == list(expected)
    _, add = _add(fe, messages=CHAT[:1], add_generation_prompt=False, request_id="no-gen")
    assert add.prompt_token_ids == list(
        hf["demo"].apply_chat_template(CHAT[:1], add_generation_prompt=False, return_dict=False)
    )


def test_stop_string_kept_and_special_tokens_shown_when_asked(live_frontend, ours) -> None:
    tok = ours["demo"]
    fe = live_frontend()
    text_ids = tok.encode(" one two three four", add_special_tokens=False)
    sock, add = _add(fe, prompt="count:", stop=["three"], include_stop_str_in_output=True)
    final = _finish(fe, sock, add, text_ids)
    assert final["text"] == " one two three" and final["finish_reason"] == "stop"
    sock, add = _add(fe, prompt="count:", stop=["three"], request_id="cut")
    assert _finish(fe, sock, add, text_ids)["text"] == " one two "
    special = [t for t in tok.all_special_ids if t in tok.skipped_ids][0]
    shown = tok.decode([special], skip_special_tokens=False)
    sock, add = _add(fe, prompt="x", skip_special_tokens=False, request_id="shown")
    assert _finish(fe, sock, add, text_ids[:1] + [special])["text"] == tok.decode(text_ids[:1]) + shown
    sock, add = _add(fe, prompt="x", request_id="skipped")
    assert _finish(fe, sock, add, text_ids[:1] + [special])["text"] == tok.decode(text_ids[:1])


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"prompt": "x", "continue_final_message": True}, "'continue_final_message' applies to 'messages' only"),
        ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "'truncate_prompt_tokens'"),
        ({"prompt": "x", "skip_special_tokens": 1}, "'skip_special_tokens'"),
    ],
)
def test_bad_frontend_fields_are_named_in_the_final(live_frontend, fields, needle) -> None:
    fe = live_frontend()
    sock = fe.client()
    fe.send(sock, type="generate", request_id="bad", **fields)
    final = fe.until_final(sock)[-1]
    assert final["finish_reason"] == "error" and needle in final["error"], final


def test_chat_template_kwargs_reach_the_template_as_in_transformers(tmp_path, tokenizer_dirs) -> None:
    import json
    import shutil

    import transformers

    from conveyor.frontend.tokenizer import Tokenizer

    root = tmp_path / "thinking"
    shutil.copytree(tokenizer_dirs["chatml"], root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] += "{%- if enable_thinking %}{{- '<think>' }}{%- endif %}"
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(root), transformers.AutoTokenizer.from_pretrained(str(root))
    for kwargs in ({"enable_thinking": True}, {"enable_thinking": False}, {}):
        text = ours.render_chat(CHAT[:1], variables=kwargs)
        assert text == hf.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours.render_chat(CHAT[:1], variables={"enable_thinking": True}).endswith("<think>")
