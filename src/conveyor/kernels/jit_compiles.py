"""Count the Triton kernel variants a process JIT-compiles, so a benchmark can say whether a
timed window paid for compiles (docs/gpu-first-light.md, "Triton JIT inside timed runs").

Triton compiles a kernel on the first launch of each specialization (dtypes, constexprs, an
int argument divisible by 16 or not) and keeps it in the JITFunction's in-memory cache; a
variant found in Triton's on-disk cache is loaded through the same path, so the count is
"variants this process had to produce", the ones that cost a first launch. Triton calls
``knobs.runtime.jit_post_compile_hook`` after each (Triton >= 3.4; before it the class
attribute ``JITFunction.compiled_hook``). Under the interpreter (``TRITON_INTERPRET=1``, the
CPU) nothing is compiled and the count stays 0.

The hook costs nothing per launch: Triton calls it only when it compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The worker's profile counter of these compiles (bin/bench reads it around each timed window).
COUNTER = "triton_compiles"


def count_compiles(add: Callable[[int], Any]) -> bool:
    """Call ``add(1)`` after every Triton JIT compile in this process, keeping any hook already
    installed (it is called first, and its return value is passed on). Returns False, changing
    nothing, when Triton is missing or offers no compile hook (then no count can be given)."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
        owner, name = knobs, "jit_post_compile_hook"
    else:
        from triton.runtime.jit import JITFunction

        if not hasattr(JITFunction, "compiled_hook"):
            return False
        owner, name = JITFunction, "compiled_hook"
    previous = getattr(owner, name)

    def hook(*args: Any, **kwargs: Any) -> Any:
        result = previous(*args, **kwargs) if previous is not None else None
        add(1)
        return result

    setattr(owner, name, hook)
    return True
