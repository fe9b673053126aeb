"""lm-eval's ``local-completions`` model (pinned in the test extra) against bin/serve
--http-port: a small log-likelihood task of the project's own, scored through
``/v1/completions`` (token-id prompts, ``echo`` + ``logprobs`` + ``max_tokens`` 1, as lm-eval
sends them), gives per item the log-likelihood and greediness that lm-eval's ``hf`` model
computes on the same checkpoint, within 1e-4."""

from __future__ import annotations

import pytest

from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import http_serve, stop_and_check

# A few multiple-choice items as lm-eval's loglikelihood requests: (context, continuation).
# Contexts of several lengths, one-token and longer continuations, one empty-ish context
# word; the demo tokenizer splits them into its own pieces.
TASK = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Berlin"),
    ("Two plus two equals", " four"),
    ("Two plus two equals", " five and a half"),
    ("Question: which animal barks? Answer:", " the dog"),
    ("Question: which animal barks? Answer:", " the cat"),
    ("Once upon a time there was a little girl who lived in a village near the forest.", " She"),
    ("Hello", " world, this is a longer continuation of several tokens"),
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    args = [
        "--model",
        str(tiny_checkpoint),
        "--num-kv-blocks",
        "96",
        "--block-size",
        "8",
        "--threads",
        "1",
        "--http-port",
        "0",
    ]
    running = http_serve(ServeProcess(args, tmp_path_factory.mktemp("lm-eval")))
    yield running
    stop_and_check(running)


def _requests():
    from lm_eval.api.instance import Instance

    return [
        Instance(request_type="loglikelihood", doc={"id": i}, arguments=pair, idx=0, metadata=("conveyor", i, 1))
        for i, pair in enumerate(TASK)
    ]


def test_local_completions_loglikelihoods_equal_lm_eval_hf(server, tiny_checkpoint) -> None:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    served = LocalCompletionsAPI(
        model=tiny_checkpoint.name,
        base_url=server.url + "/v1/completions",
        tokenizer=str(tiny_checkpoint),
        tokenizer_backend="huggingface",
        batch_size=4,  # prompts travel as a list of token-id lists
        max_length=256,
        max_retries=1,
        add_bos_token=True,  # both models read the items as the tokenizer encodes a text: BOS first
    )
    ours = served.loglikelihood(_requests(), disable_tqdm=True)
    reference = HFLM(
        pretrained=str(tiny_checkpoint), device="cpu", dtype="float32", batch_size=1, max_length=256, add_bos_token=True
    )
    theirs = reference.loglikelihood(_requests(), disable_tqdm=True)
    assert len(ours) == len(theirs) == len(TASK)
    for pair, (lp, greedy), (ref_lp, ref_greedy) in zip(TASK, ours, theirs):
        assert lp == pytest.approx(ref_lp, abs=1e-4), pair
        assert greedy == ref_greedy, pair
    assert len({round(lp, 3) for lp, _ in ours}) > 4  # the items score differently: a real comparison
