"""bin/bench's decode-step roofline (conveyor_tools.bench.roofline): the bytes a decode step
must read, and the decode steps of a run set beside them."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from conveyor.checkpoints.model_config import ModelConfig
from conveyor_tools.bench import roofline


def test_weight_bytes_are_the_checkpoints_parameters(tiny_checkpoint) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    numel = 0
    for file in tiny_checkpoint.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                numel += _prod(f.get_slice(name).get_shape())
    assert roofline.weight_bytes(config, 4) == 4 * numel
    assert roofline.weight_bytes(config, 2) == 2 * numel


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def test_kv_bytes_per_token(tiny_checkpoint) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    assert roofline.kv_bytes_per_token(config, 4) == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


def test_decode_steps_grouped_by_batch_beside_their_bytes(tiny_checkpoint) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    records = {
        "step_prefill_tokens": [40, 0, 0, 0, 0],  # the first step is a prefill: left out
        "step_decode_seqs": [0, 1, 1, 2, 2],
        "step_context_tokens": [40, 41, 43, 100, 102],
        "step_time": [9.0, 2.0, 4.0, 6.0, 8.0],
    }
    bandwidth = 1e9
    rows = roofline.decode_roofline(records, config, 4, bandwidth)
    assert [(r["batch"], r["steps"]) for r in rows] == [(1, 2), (2, 2)]
    one = rows[0]
    assert one["measured_ms"] == 3.0 and one["context_tokens"] == 42
    expected = 1e3 * (roofline.weight_bytes(config, 4) + 42 * roofline.kv_bytes_per_token(config, 4)) / bandwidth
    assert one["roofline_ms"] == pytest.approx(expected)
    assert one["ratio"] == pytest.approx(3.0 / expected)
    assert "copy bandwidth 1.0 GB/s" in roofline.roofline_table("conveyor", rows, bandwidth)


def test_copy_bandwidth_is_measured() -> None:
    assert roofline.copy_bandwidth(1 << 20, 2) > 1e8  # any machine copies 100 MB/s


def test_dtype_bytes_follow_serves_rule(tiny_checkpoint) -> None:
    config = ModelConfig.from_dir(tiny_checkpoint)
    assert roofline.dtype_bytes_of("auto", "cpu", config) == 4
    assert roofline.dtype_bytes_of("bfloat16", "cpu", config) == 2
