"""A step never makes the host wait for the device on its way to the device.

On CUDA a copy from host memory made without ``non_blocking`` (``x.to(device)``,
``torch.tensor(..., device=)``, ``torch.as_tensor(..., device=)``) synchronizes the stream: the
host waits for every kernel already queued, the forward just launched included, so the next
step is no longer prepared while this one runs (the runner's pipelining, model_runner.py). With
``non_blocking`` a copy from pageable memory is staged before the call returns, so the host may
reuse its buffer at once. The rule is plain Python, the same on a CPU: this drives the engine
through every kind of step (chunked prefill, mixed, decode, speculative verify, grammar-
constrained rows, logit bias and min_tokens, a fork's block copy) and records each upload of host data that is not
``non_blocking``.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.engine.conftest import GREEDY, run_all
from tests.engine.test_speculative import SPEC, repetitive


class BlockingUploads(TorchFunctionMode):
    """Records where host data (``from_numpy``, ``torch.tensor`` / ``as_tensor`` without a
    device) is moved with ``.to(device)`` and no ``non_blocking``, or built on a device at once."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, torch.Tensor] = {}  # id -> the tensor (held, so ids stay unique)
        self.found: list[str] = []

    def tag(self, tensor: torch.Tensor) -> torch.Tensor:
        self.host[id(tensor)] = tensor
        return tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            if kwargs.get("device") is not None:
                self.found.append(f"torch.{func.__name__}(..., device=) at {_caller()}")
                return func(*args, **kwargs)
            return self.tag(func(*args, **kwargs))
        if func is torch.Tensor.to and id(args[0]) in self.host and not kwargs.get("non_blocking"):
            if "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:]):
                self.found.append(f".to(device) of host data at {_caller()}")
        return func(*args, **kwargs)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/src/conveyor/" in f.filename]
    return f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}" if frames else "?"


def test_the_recorder_catches_blocking_uploads(monkeypatch):
    """It flags the three forms and passes their non-blocking versions (else the test below
    proves nothing)."""
    mode = BlockingUploads()
    real = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: mode.tag(real(a)))
    with mode:
        torch.from_numpy(torch.arange(3).numpy()).to("cpu")
        torch.tensor([1, 2]).to(device=torch.device("cpu"))
        torch.as_tensor([1], device="cpu")
        assert len(mode.found) == 3
        torch.from_numpy(torch.arange(3).numpy()).to("cpu", non_blocking=True)
        torch.tensor([1, 2]).to(torch.long)  # a dtype change moves nothing
        torch.zeros(3, device="cpu").to("cpu")  # not host data
    assert len(mode.found) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine runs interpreted kernels on CPU tensors here")
def test_no_step_uploads_host_data_blocking(tiny_engine, monkeypatch):
    engine = tiny_engine(max_batch_size=6, max_batch_tokens=16, attention="triton", **SPEC)
    requests = [
        engine.add_request(token_ids=repetitive(1) * 2, max_tokens=10, **GREEDY),  # chunked; proposals verified
        engine.add_request(
            token_ids=[5, 17, 29, 41],
            max_tokens=8,
            temperature=0.8,
            seed=1,
            min_tokens=4,
            logit_bias={7: 5.0, 9: -100.0},
            presence_penalty=0.5,
        ),
        engine.add_request(
            prompt="pick",
            max_tokens=20,
            temperature=1.0,
            seed=2,
            constraint={"type": "choice", "choices": ["yes", "no"]},
        ),
        # n = 2 over a partly filled last block: the forked sequence's block copy
        engine.add_request(token_ids=[3, 4, 5, 6, 7, 8], max_tokens=4, n=2, temperature=1.0, seed=5),
    ]
    mode = BlockingUploads()
    real = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: mode.tag(real(a)))
    with mode:
        run_all(engine)
    assert all(r.done for r in requests) and requests[2].text in ("yes", "no")
    assert engine.stats()["spec_num_proposals"] > 0
    assert sorted(set(mode.found)) == []
