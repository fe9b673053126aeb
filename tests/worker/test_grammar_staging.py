"""The grammar bitmask's host staging (conveyor.worker.grammar_rows.MaskStaging): allocated
once and reused step after step; beside a GPU pinned, uploaded with ``non_blocking`` (a copy
from pinned memory is only enqueued), two buffers in turn, each written again only after the
event recorded behind its last copy. The CUDA branch runs here with the device calls recorded
(pinning, the copy, the events), as tests/engine/test_step_uploads.py records uploads; the
gpu-marked test runs it for real."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conveyor.worker.grammar_rows import MaskStaging

VOCAB = 100  # 4 words a row
CUDA = torch.device("cuda")


def test_cpu_reuses_one_buffer_and_uploads_nothing():
    staging = MaskStaging()
    first = staging.take(3, VOCAB, torch.device("cpu"))
    first.fill_(7)
    assert staging.upload(first, torch.device("cpu")) is first
    again = staging.take(2, VOCAB, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 4)
    grown = staging.take(5, VOCAB, torch.device("cpu"))  # more rows: a larger buffer, once
    assert grown.shape == (5, 4) and staging.take(6, VOCAB, torch.device("cpu")).data_ptr() == grown.data_ptr()
    assert staging.take(2, 40 * 32, torch.device("cpu")).shape == (2, 40)  # another vocabulary width


class FakeEvent:
    log: list[str] = []

    def __init__(self) -> None:
        self.name = f"event{len([e for e in self.log if e.startswith('new')])}"
        self.log.append(f"new {self.name}")

    def record(self) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


class DeviceCalls(TorchFunctionMode):
    """Pinning marks a host tensor; a copy to "cuda" is recorded (source, pinned, non_blocking)
    and returns a clone standing for the device tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: set[int] = set()
        self.copies: list[tuple[int, bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            self.pinned.add(args[0].data_ptr())
            FakeEvent.log.append("pin")
            return args[0]
        if func is torch.Tensor.to and (
            args[1:] and str(args[1]).startswith("cuda") or "cuda" in str(kwargs.get("device"))
        ):
            source = args[0]
            self.copies.append((source.data_ptr(), source.data_ptr() in self.pinned, bool(kwargs.get("non_blocking"))))
            FakeEvent.log.append("copy")
            return source.clone()
        return func(*args, **kwargs)


def test_cuda_stages_through_two_pinned_buffers_uploaded_non_blocking(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.log = []
    staging = MaskStaging()
    calls = DeviceCalls()
    with calls:
        uploads = []
        for step in range(4):
            host = staging.take(3, VOCAB, CUDA)
            host.fill_(step)
            uploads.append((host.data_ptr(), staging.upload(host, CUDA)))
    assert FakeEvent.log[:4] == ["pin", "pin", "new event0", "new event1"]  # allocated once
    ptrs = [p for p, _ in uploads]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]  # two buffers in turn
    assert calls.copies == [(p, True, True) for p in ptrs]  # every copy from pinned memory, non_blocking
    assert [int(mask[0, 0]) for _, mask in uploads] == [0, 1, 2, 3]
    # Each buffer's event is recorded after its copy and waited on before it is written again.
    assert FakeEvent.log[4:] == [
        "copy",
        "record event0",
        "copy",
        "record event1",
        "wait event0",
        "copy",
        "record event0",
        "wait event1",
        "copy",
        "record event1",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_from_pinned_buffers_for_real():
    staging = MaskStaging()
    seen = set()
    for step in range(6):
        host = staging.take(4, 128 * 1024, CUDA)
        assert host.is_pinned()
        host.fill_(step)
        mask = staging.upload(host, CUDA)
        seen.add(host.data_ptr())
        assert mask.is_cuda and torch.equal(mask.cpu(), torch.full_like(host, step))
    assert len(seen) == 2
