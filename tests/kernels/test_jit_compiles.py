"""The worker's count of Triton JIT compiles (conveyor.kernels.jit_compiles): bin/bench reads it
around each timed window to say whether the window paid for compiles. Triton calls the hook
only when it compiles, which needs a GPU; here the hook is installed on this Triton and called
as Triton calls it (keyword arguments), and a hook installed before it must keep working."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from conveyor.kernels.jit_compiles import count_compiles  # noqa: E402


def hook_slot():
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
        return knobs, "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "compiled_hook"


def test_each_compile_is_counted_and_an_earlier_hook_still_runs(monkeypatch):
    owner, name = hook_slot()
    earlier = []
    monkeypatch.setattr(owner, name, lambda **kwargs: earlier.append(kwargs["key"]) or "kept")
    counted = []
    assert count_compiles(counted.append)
    hook = getattr(owner, name)
    assert (
        hook(key="k1", repr="kernel[...]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
        == "kept"
    )
    hook(key="k2", repr="kernel[...]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert counted == [1, 1] and earlier == ["k1", "k2"]


def test_no_earlier_hook(monkeypatch):
    owner, name = hook_slot()
    monkeypatch.setattr(owner, name, None)
    counted = []
    assert count_compiles(counted.append)
    getattr(owner, name)(key="k", repr="", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert counted == [1]
