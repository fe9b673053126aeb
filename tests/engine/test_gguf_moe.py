"""Mixture-of-experts models from GGUF files: tiny random Qwen3-MoE and Mixtral written the way
llama.cpp's converter writes them (tests/gguf_files.py: stacked ``ffn_*_exps`` experts, the F32
router ``ffn_gate_inp``, the ``expert_*`` counts; Mixtral as ``llama`` with experts), quantized,
served through ``conveyor.Engine`` with greedy tokens equal to transformers' on the weights the
file holds (transformers' own GGUF reader cannot load either: it reads no expert width for
``qwen3moe`` and has no Mixtral), on one rank and on two with the experts split; and every
bad expert tensor or field refused at start with one line naming it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conveyor.checkpoints.gguf.reader import hf_config, hf_tensors, open_gguf
from conveyor.runtime.model_source import StartupError, resolve_model
from tests.engine.conftest import GREEDY, TINY, run_all
from tests.engine.test_speculative import repetitive
from tests.gguf_files import gguf_name, round_trip, stored_type, write_gguf

# family of tests/checkpoints.py -> (GGUF architecture, matrix type, config changes, extra metadata).
# Qwen3-MoE: its middle layer dense, top-k weights not renormalized (llama.cpp renormalizes unless
# expert_weights_norm says otherwise). Mixtral: full attention (GGUF's llama has no window),
# experts of width 48, so their down projections fall back to F16 beside Q4_0 gate/up.
CASES = {
    "qwen3_moe": ("qwen3moe", Q.Q8_0, {}, {"qwen3moe.expert_weights_norm": ("bool", False)}),
    "mixtral": ("llama", Q.Q4_0, {"sliding_window": None}, {}),
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch) -> None:
    """The prepared directories of this module's throwaway files go to a temporary cache."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(family)``: that case's file and reference (:func:`_build`), built once per module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = _build(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="module", params=list(CASES))
def moe_gguf(request, built):
    return built(request.param)


def _build(family: str, root):
    """``(GGUF path, the HF model holding the file's dequantized weights, greedy(prompt, n))``."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import moe_serving_checkpoint

    arch, qtype, changes, metadata = CASES[family]
    (root / "hf").mkdir()
    directory = moe_serving_checkpoint(root / "hf", family, **changes)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    path = write_gguf(root / f"tiny.{qtype.name}.gguf", model, qtype, arch=arch, tokenizer=True,
                      extra_metadata=metadata)  # fmt: skip
    with torch.no_grad():  # the reference: the same model on the values the file holds
        for name, param in model.state_dict().items():
            values = param.numpy()
            if name.endswith("gate_up_proj"):  # written as two tensors, gate rows then up rows
                half = values.shape[1] // 2
                qtype_exps = stored_type("ffn_up_exps.weight", values, qtype)
                parts = [round_trip(values[:, i * half : (i + 1) * half], qtype_exps) for i in range(2)]
                param.copy_(torch.from_numpy(np.concatenate(parts, axis=1)))
            else:
                param.copy_(torch.from_numpy(round_trip(values, stored_type(gguf_name(name, arch), values, qtype))))

    @functools.cache
    def greedy_of(prompt: tuple[int, ...], n: int) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return out[0, len(prompt) :].tolist()

    def greedy(prompt: list[int], n: int) -> list[int]:  # (the tests ask for some prompts twice)
        return greedy_of(tuple(prompt), n)

    return path, model, greedy


def test_expert_tensors_read_as_the_file_holds_them(moe_gguf) -> None:
    """Every stacked tensor split into its experts under the checkpoint's names, each equal to the
    reference's expert (the q/k rows of Mixtral back in HF order), the config from the metadata."""
    path, model, _ = moe_gguf
    reader = open_gguf(path)
    config, _ = hf_config(reader, path)
    ours = dict(hf_tensors(reader, config, path))
    module = "mlp" if model.config.model_type == "qwen3_moe" else "block_sparse_moe"
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if module == "mlp" else ("w1", "w3", "w2")
    expected = {}
    for name, values in model.state_dict().items():
        prefix = name.rsplit(".mlp.", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            half = values.shape[1] // 2
            for e in range(values.shape[0]):
                expected[f"{prefix}.{module}.experts.{e}.{gate}.weight"] = values[e, :half]
                expected[f"{prefix}.{module}.experts.{e}.{up}.weight"] = values[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(values.shape[0]):
                expected[f"{prefix}.{module}.experts.{e}.{down}.weight"] = values[e]
        elif name.endswith("mlp.gate.weight"):
            expected[f"{prefix}.{module}.gate.weight"] = values
        else:
            expected[name] = values
    assert set(ours) == set(expected)
    for name, values in ours.items():
        assert torch.equal(torch.from_numpy(np.array(values)), expected[name]), name
    if module == "mlp":
        assert config["mlp_only_layers"] == [1] and config["norm_topk_prob"] is False
        assert config["moe_intermediate_size"] == model.config.moe_intermediate_size
    else:
        assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 8


def test_greedy_through_chunked_prefill_equals_transformers(moe_gguf) -> None:
    from conveyor import Engine

    path, model, greedy = moe_gguf
    prompts = [repetitive(i) for i in range(2)] + [[5, 17, 29, 41, 53, 65, 77]]
    with Engine(str(path), **TINY, max_batch_tokens=12, quantization="none") as engine:
        assert engine.model_config.architecture == model.config.architectures[0]
        requests = [engine.add_request(token_ids=p, max_tokens=8, **GREEDY) for p in prompts]
        run_all(engine)
        assert engine.stats()["held_blocks"] == 0
    for prompt, request in zip(prompts, requests):
        assert request.tokens == greedy(prompt, 8)


def test_two_ranks_with_the_experts_split_equal_transformers(built) -> None:
    """Mixtral on two ranks, rank 1 a worker process reading only the experts it holds, each
    sliced out of its stack (one architecture: the read per expert is the same for both)."""
    from conveyor import Engine

    path, _, greedy = built("mixtral")
    prompts = [repetitive(i) for i in range(2)]
    with Engine(str(path), **{**TINY, "threads": 1}, tensor_parallel_size=2, expert_parallel=True,
                distributed_timeout_s=60, quantization="none") as engine:  # fmt: skip
        requests = [engine.add_request(token_ids=p, max_tokens=8, **GREEDY) for p in prompts]
        run_all(engine)
        assert engine.runner.model.layers[0].mlp.shard.count == 4
    for prompt, request in zip(prompts, requests):
        assert request.tokens == greedy(prompt, 8)


def test_quantization_gguf_serves_the_experts_as_the_files_blocks(built) -> None:
    """``--quantization gguf`` on the Q8_0 Qwen3-MoE: every expert an int8 method of the file's
    blocks (tests/worker/test_quantized_experts.py checks their products), the router float; on
    these prompts its greedy tokens still equal the float reference's."""
    from conveyor import Engine
    from conveyor.worker.quantization.methods import Int8Weights

    path, _, greedy = built("qwen3_moe")
    prompts = [repetitive(i) for i in range(2)] + [[5, 17, 29, 41, 53, 65, 77]]
    with Engine(str(path), **TINY, quantization="gguf") as engine:
        mlp = engine.runner.model.layers[2].mlp
        assert mlp.w13 is None and all(type(m) is Int8Weights for m in mlp.quantized["w13"].quant)
        requests = [engine.add_request(token_ids=p, max_tokens=8, **GREEDY) for p in prompts]
        run_all(engine)
    for prompt, request in zip(prompts, requests):
        assert request.tokens == greedy(prompt, 8)


@pytest.mark.parametrize(
    "case, needle",
    [
        (
            {"extra_tensors": {"blk.0.ffn_down_exps.weight": np.zeros((8, 32, 64), np.float32)}},
            "tensor blk.0.ffn_down_exps.weight has shape (8, 32, 64), expected (8, 64, 32)",
        ),
        (
            {"extra_tensors": {"blk.2.ffn_gate_exps.weight": np.zeros((7, 32, 64), np.float32)}},
            "tensor blk.2.ffn_gate_exps.weight has shape (7, 32, 64), expected (8, 32, 64)",
        ),
        ({"skip_metadata": ("qwen3moe.expert_count",)}, "metadata field qwen3moe.expert_count is missing"),
        (
            {"extra_metadata": {"qwen3moe.expert_shared_count": ("uint32", 1)}},
            "shared experts are not supported",
        ),
        (
            {"extra_metadata": {"qwen3moe.expert_gating_func": ("uint32", 2)}},
            "only softmax routing (1) is supported",
        ),
    ],
    ids=["down-shape", "expert-count", "missing-count", "shared", "sigmoid"],
)
def test_bad_expert_tensors_and_fields_get_one_clear_error(case, needle, tmp_path) -> None:
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint("qwen3_moe", tmp_path / "hf")
    path = write_gguf(tmp_path / "bad.gguf", model, arch="qwen3moe", **case)
    with pytest.raises(StartupError, match="--model") as caught:
        resolve_model(str(path))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_per_expert_tensors_of_older_files_read_as_stacked_ones(tmp_path) -> None:
    """A Mixtral converted before llama.cpp stacked experts (``blk.N.ffn_gate.E.weight`` ...)
    reads to the same tensors as the stacked file; a wrong per-expert shape is refused by name."""
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint("mixtral", tmp_path / "hf")
    stacked = write_gguf(tmp_path / "stacked.gguf", model, Q.Q8_0)
    older = write_gguf(tmp_path / "older.gguf", model, Q.Q8_0, stacked_experts=False)
    assert "blk.1.ffn_down.7.weight" in {t.name for t in open_gguf(older).tensors}
    read = []
    for path in (stacked, older):
        reader = open_gguf(path)
        config, _ = hf_config(reader, path)
        read.append((config, {name: np.array(values) for name, values in hf_tensors(reader, config, path)}))
    (config, ours), (config_older, theirs) = read
    assert config_older == config and config["architectures"] == ["MixtralForCausalLM"]
    assert set(ours) == set(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in ours)
    (tmp_path / "bad").mkdir()
    bad = write_gguf(tmp_path / "bad" / "older.gguf", model, stacked_experts=False,
                     extra_tensors={"blk.1.ffn_up.3.weight": np.zeros((48, 32), np.float32)})  # fmt: skip
    with pytest.raises(
        StartupError, match=r"tensor blk\.1\.ffn_up\.3\.weight has shape \(48, 32\), expected \(48, 64\)"
    ):
        resolve_model(str(bad))
