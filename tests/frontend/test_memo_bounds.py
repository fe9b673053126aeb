"""The per-token memos of the streaming path stay bounded whatever the vocabulary, and a memo
that overflows (its older half dropped) changes no delta: the tokenizer's streaming memos
(``decode_one``, ``stream_piece``, ``stream_token_bytes``: at most ``memo_max`` entries each)
under ``IncrementalDetokenizer`` for every test tokenizer, and the frontend's delta tails
(``OutputPath._delta_tails``, at most ``DELTA_TAILS_MAX`` entries) on a live frontend
(conftest.py: ``live_frontend``) against a stand-in scheduler."""

from __future__ import annotations

import random
import time

import pytest

from conveyor.frontend import output
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.tokenizer import STREAM_MEMO_MAX, Tokenizer
from conveyor.ipc.messages import AddRequest, RequestOutput, TokenOutputs

TEXT = "Café déjà vu — naïve Straße! 😀 你好世界 👨‍👩‍👧 🇫🇷 日本語. The lighthouse keeper wrote in his log."
STREAMS = 16
MEMO_MAX = 32


def memo_sizes(tok: Tokenizer) -> list[int]:
    return [len(m) for memos in (tok._decoded_one, tok._pieces, tok._token_bytes) for m in memos.values()]


@pytest.mark.parametrize("name", ["bytelevel", "chatml", "spm", "spm_legacy", "demo"])
def test_tokenizer_memos_stay_bounded_and_deltas_stay_right(name, tokenizer_dirs, ours) -> None:
    """Every token of the vocabulary (and a few past it) twice in random order, in random
    chunks after random prompts, then text: each memo holds at most memo_max entries, and
    every delta equals the window decode's (``fast_paths=False``: no piece memo)."""
    tok = Tokenizer.from_dir(tokenizer_dirs[name], memo_max=MEMO_MAX)
    assert Tokenizer.from_dir(tokenizer_dirs[name])._memo_max == STREAM_MEMO_MAX
    pieces = tok.stream_pieces()
    rng = random.Random(name)
    vocab = list(range(tok.vocab_size + 3)) * 2
    rng.shuffle(vocab)
    output = vocab + tok.encode(TEXT * 3, add_special_tokens=False)
    largest = 0
    for skip in (True, False):
        for start in range(0, len(output), 300):
            prompt = tok.encode(rng.choice(["", "Question:", "Translate: 你好", "<|im_start|>assistant\n"]))
            fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            ref = IncrementalDetokenizer(ours[name], prompt, skip_special_tokens=skip, fast_paths=False)
            i = start
            while i < min(start + 300, len(output)):
                chunk = output[i : i + rng.choice([1, 1, 1, 2, 5])]
                assert fast.push(chunk) == ref.push(chunk)
                i += len(chunk)
                largest = max(largest, *memo_sizes(tok))
            assert fast.flush() == ref.flush()
    assert MEMO_MAX // 2 < largest <= MEMO_MAX  # filled up, and no further
    assert tok.stream_pieces() is pieces  # dropping keeps the memo the detokenizers hold
    with pytest.raises(ValueError, match="memo_max"):
        Tokenizer.from_dir(tokenizer_dirs[name], memo_max=0)


def test_delta_tails_stay_bounded_and_deltas_stay_right(live_frontend, ours, monkeypatch) -> None:
    """Every token of the vocabulary streamed, then text: the hot path keeps at most
    DELTA_TAILS_MAX tails, and every delta is the reference detokenizer's."""
    tok = ours["demo"]
    monkeypatch.setattr(output, "DELTA_TAILS_MAX", 64)
    fe = live_frontend()
    socks, sids, refs = [], [], []
    for i in range(STREAMS):
        socks.append(fe.client())
        fe.send(socks[-1], type="generate", request_id=f"s{i}", prompt="Say:", max_tokens=4000, stream=True)
        add = fe.scheduler_recv()
        assert isinstance(add, AddRequest)
        sids.append(add.request_id)
        refs.append(IncrementalDetokenizer(tok, add.prompt_token_ids, fast_paths=False))
    text_ids = tok.encode(TEXT * 2, add_special_tokens=False)
    tokens = list(range(5, tok.vocab_size)) + text_ids * STREAMS  # the vocabulary, then text in every stream
    steps = [tokens[i : i + STREAMS] for i in range(0, len(tokens) - STREAMS + 1, STREAMS)]
    sizes, texts = [], [[] for _ in range(STREAMS)]
    for n, step in enumerate(steps):
        if n == 0:
            now = time.time()
            first = [RequestOutput(s, [t], scheduled_time=now, first_token_time=now) for s, t in zip(sids, step)]
            fe.scheduler_send(TokenOutputs(first))
        else:
            fe.scheduler_send(TokenOutputs([], sids, step))  # one step's columns: the hot path
        for sock, ref, text, token in zip(socks, refs, texts, step):
            msg = fe.recv(sock)
            assert msg["type"] == "delta" and msg["token_ids"] == [token]
            assert msg["text"] == ref.push([token]), (n, token)
            text.append(msg["text"])
        sizes.append(len(fe.frontend.output._delta_tails))
    assert 32 < max(sizes) <= 64 and sizes[-1] <= 64  # filled up, and no further
    fe.scheduler_send(TokenOutputs([RequestOutput(s, [], finish_reason="length") for s in sids]))
    for sock, ref, text in zip(socks, refs, texts):
        msgs = []
        while (msg := fe.recv(sock)) is not None:
            msgs.append(msg)
            if msg["type"] == "final":
                break
        assert msgs[-1]["type"] == "final" and msgs[-1]["text"] == "".join(text) + ref.flush()
