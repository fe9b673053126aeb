"""Weight updates in place (worker/weight_updates.py): from a checkpoint directory, from named
tensors and from a trainer's broadcast over a gloo group of its own. After an update the model
holds exactly what a fresh load of the new checkpoint holds (every parameter and the packed
CPU copies derived from them); a bad update is refused before the first copy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conveyor.worker.loader import load_model
from conveyor.worker.weight_updates import (
    update_from_disk,
    update_from_group,
    update_from_tensors,
    weight_update_group,
)
from tests.checkpoints import SMALL, build, gemma3_serving_checkpoint
from tests.trainer_group import trainer_broadcasting


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two Llamas of one shape and different weights: the served one and the trained one."""
    config = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    old, new = tmp_path_factory.mktemp("old"), tmp_path_factory.mktemp("new")
    build(config, old, seed=1)
    build(config, new, seed=2)
    return old, new


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and every packed CPU weight of ``model``."""
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if getattr(module, "packed", None) is not None:
            state[name + ".packed"] = module.packed.to_dense() if module.packed.is_mkldnn else module.packed.clone()
    return state


def _assert_same(model, reference) -> None:
    got, want = _state(model), _state(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_update_from_disk_equals_a_fresh_load(checkpoints):
    old, new = checkpoints
    model, _ = load_model(old)
    update_from_disk(model, new)
    _assert_same(model, load_model(new)[0])


def test_update_from_named_tensors_equals_a_fresh_load(checkpoints):
    old, new = checkpoints
    model, _ = load_model(old)
    trained = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
    update_from_tensors(model, trained.state_dict().items())
    _assert_same(model, load_model(new)[0])


def test_a_bad_update_is_refused_whole(checkpoints):
    old, new = checkpoints
    model, _ = load_model(old)
    tensors = dict(AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict())
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing weights: model.norm.weight"):
        update_from_tensors(model, missing.items())
    wrong = {**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1]}
    with pytest.raises(ValueError, match="wrong shapes: lm_head.weight"):
        update_from_tensors(model, wrong.items())
    with pytest.raises(ValueError, match="unknown weights: extra"):
        update_from_tensors(model, [*tensors.items(), ("extra", torch.zeros(1))])
    _assert_same(model, load_model(old)[0])


def test_gemma_norms_are_derived_once_per_update(tmp_path):
    """Gemma 3 stores norms as ``w`` and multiplies by ``1 + w``: an update re-derives them
    from the new stored weights, never adding 1 twice."""
    directory = gemma3_serving_checkpoint(tmp_path)
    model, _ = load_model(directory)
    update_from_disk(model, directory)
    _assert_same(model, load_model(directory)[0])


def test_update_from_a_trainers_broadcast(checkpoints):
    """The trainer (group rank 0, here a thread) broadcasts its weights; the server's rank
    (group rank 1) receives them into its model."""
    old, new = checkpoints
    model, _ = load_model(old)
    trained = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict()
    with trainer_broadcasting(trained, 2) as (address, specs):
        update_from_group(model, weight_update_group(address, 1, 2, timeout_s=60), specs)
    _assert_same(model, load_model(new)[0])
