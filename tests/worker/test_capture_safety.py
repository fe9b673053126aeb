"""What a CUDA graph captures must not need the host: checked on a CPU before any GPU sees it.

A decode graph (:mod:`conveyor.worker.cuda_graphs`) records the device work of one call of the
runner's decode forward and replays it with new inputs. Anything in that call that reads a
device value on the host (``.item()``, ``.tolist()``, ``bool(tensor)``, a data-dependent shape
such as ``nonzero`` or boolean-mask indexing) either fails the capture (a sync while capturing
is an error) or freezes one step's value into every replay, and a tensor built from host data
there (``torch.tensor``, ``from_numpy``) is a copy from a host buffer the replay no longer owns.
Those are plain Python paths, the same on a CPU: this runs the forward over every input the
capture would use, through the Triton backend and the fused layer kernels (interpreted), with
all of them made to raise. Triton's interpreter itself reads its arguments on the host, so the
check pauses inside a kernel launch (on a GPU a launch is one asynchronous call).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conveyor.kernels import layer_ops, paged_decode
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.model_runner import ModelRunner
from tests.worker.conftest import rewrite_config

#: Tensor methods and functions that wait for the device or build a tensor from host data.
HOST_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
    torch.tensor,
    torch.as_tensor,
}


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchFunctionMode):
    """Raises on any of :data:`HOST_SYNCS` and on indexing with a boolean mask; ``paused``
    while a (interpreted) Triton kernel runs."""

    paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            if func in HOST_SYNCS:
                raise HostSyncError(f"{getattr(func, '__qualname__', func)} inside the captured region")
            if func is torch.Tensor.__getitem__ and _has_bool_index(args[1]):
                raise HostSyncError("boolean-mask indexing (a data-dependent shape) inside the captured region")
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextlib.contextmanager
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[NoHostSync]:
    from triton.runtime import interpreter

    mode = NoHostSync()
    real_run = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        mode.paused = True
        try:
            return real_run(self, *args, **kwargs)
        finally:
            mode.paused = False

    real_from_numpy = torch.from_numpy

    def from_numpy(array):
        if not mode.paused:
            raise HostSyncError("torch.from_numpy inside the captured region")
        return real_from_numpy(array)

    with monkeypatch.context() as patch:
        patch.setattr(interpreter.InterpretedFunction, "run", run)
        patch.setattr(torch, "from_numpy", from_numpy)
        with mode:
            yield mode


def test_the_guard_catches_host_syncs(monkeypatch):
    """The check fails the code it is meant to fail (else the test below proves nothing)."""
    x = torch.arange(4)
    for bad in (
        lambda: x.sum().item(),
        lambda: x.tolist(),
        lambda: bool(x[0]),
        lambda: x[x > 1],
        lambda: x.nonzero(),
        lambda: torch.tensor([1]),
        lambda: torch.from_numpy(x.numpy()),
        lambda: range(x[1]),
    ):
        with pytest.raises(HostSyncError), no_host_sync(monkeypatch):
            bad()
    with no_host_sync(monkeypatch):
        (x * 2).index_select(0, x[:2]).sum()  # device-side work is fine


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="interpreted kernels on CPU tensors; a GPU captures for real (test_cuda_graphs.py)",
)
@pytest.mark.parametrize("name,split", [("qwen3", True), ("mistral_window", False), ("qwen3_moe", True)])
def test_captured_decode_forward_never_needs_the_host(name, split, checkpoint_factory, tmp_path, monkeypatch):
    """Every (rows, q, context bound) a graph would be captured for, q = 1 and a verify's 1 + 2,
    and bounds long enough for the split-K decode and its reduce: the forward runs through the
    Triton backend and fused layers (what CUDA runs) without touching the host. Qwen3 has every
    fused kernel (q/k norm) and splits its context (split-K partials and their reduce), Mistral
    the sliding window (its short window: one partition)."""
    directory = tmp_path / name
    shutil.copytree(checkpoint_factory(name)[0], directory)
    rewrite_config(directory, lambda config: config.update(max_position_embeddings=2048))
    monkeypatch.setattr(layer_ops, "_use_triton", lambda x: True)
    runner = ModelRunner(
        RunnerConfig(
            str(directory),
            block_size=16,
            num_blocks=128,
            max_num_seqs=2,
            attention="triton",
            pad_decode=True,
            num_speculative_tokens=2,
        )
    )
    assert runner.decode.context_bounds == [512, 2048]
    graphs = DecodeGraphs(
        runner.decode.forward,
        runner.decode.buffers,
        [1 + w for w in runner.decode.verify_widths],
        runner.decode.context_bounds,
        runner.block_size,
        lambda rows, q, bound: bound,
    )
    split_k = []
    real_plan = paged_decode.plan_decode_partitions

    def plan(**kwargs):
        result = real_plan(**kwargs)
        split_k.append(result.num_partitions > 1)
        return result

    monkeypatch.setattr(paged_decode, "plan_decode_partitions", plan)
    keys = []
    with torch.inference_mode():
        for key, inputs in graphs.captures():
            with no_host_sync(monkeypatch):
                runner.decode.forward(inputs, key[2])
            keys.append(key)
            assert torch.isfinite(runner.decode.logits[: key[0] * key[1]]).all()
    assert sorted(keys) == [(r, q, b) for r in (1, 2) for q in (1, 3) for b in (512, 2048)]
    assert any(split_k) == split
