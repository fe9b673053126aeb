"""Compile every kernel for an H100 (sm_90) on a machine without a GPU, through the real wrappers.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute but not whether they
compile: it runs the Python body with numpy, so type errors in loop-carried values, unsupported
control flow, or tiles that overflow shared memory or spill registers only show up on a GPU.
Triton's wheel bundles ``ptxas``, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin)
runs on a CPU-only machine. This module swaps ``JITFunction.run`` for a compile-only version that
specializes the arguments exactly as a launch would (dtypes, 16-byte alignment and divisibility
of ints) and compiles for ``cuda:90`` instead of launching, then calls each launch wrapper with
CPU tensors of production shapes. Nothing is executed, so outputs are garbage by design.

    python -m conveyor_tools.kernels.compile_check          # table; exit 1 if a kernel fails to compile
    python -m conveyor_tools.kernels.compile_check --json   # the same as JSON (the test reads this)

It uses Triton internals (``create_function_from_signature``, ``JITFunction._pack_args``) checked
against Triton 3.9; when those move, :func:`available` says so and the test skips.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

#: Shared memory one block may use on sm_90 (227 KiB, opt-in).
SM90_MAX_SHARED = 232448


@dataclasses.dataclass
class Compiled:
    kernel: str
    constexprs: dict[str, object]
    num_warps: int
    shared: int
    registers: int | None
    stack: int | None  # bytes of per-thread stack frame: > 0 means spills (or local arrays)


def available() -> str | None:
    """``None`` when compile-only checking can run here, else the reason it cannot."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1 turns kernels into interpreted functions; unset it"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"Triton internals moved: {exc}"
    if not hasattr(JITFunction, "_pack_args"):
        return "Triton internals moved: JITFunction._pack_args"
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")):
        return "this Triton build bundles no NVIDIA toolchain"
    return None


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_all(capability: int = 90) -> list[Compiled]:
    """Run the launch wrappers over representative shapes, compiling instead of launching."""
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    results: list[Compiled] = []
    seen: set[tuple] = set()

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        key = (self.__name__, str(signature), str(sorted(constexprs.items())), str(attrs), str(options))
        if key in seen:
            return None
        seen.add(key)
        kernel = triton_compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        regs, stack = _resource_usage(kernel.asm["cubin"])
        names = {path: self.arg_names[path[0]] for path in constexprs}
        results.append(
            Compiled(
                kernel=self.__name__,
                constexprs={names[p]: v for p, v in constexprs.items() if names[p].isupper()},
                num_warps=options.num_warps,
                shared=kernel.metadata.shared,
                registers=regs,
                stack=stack,
            )
        )
        return None

    from conveyor.kernels.block_copy import _launch_copy_blocks
    from conveyor.kernels.extend_attention import extend_attention
    from conveyor.kernels.invariant_attention import invariant_attention
    from conveyor.kernels.invariant_matmul import invariant_linear
    from conveyor.kernels.invariant_softmax import row_softmax
    from conveyor.kernels.kv_store import kv_store
    from conveyor.kernels.lora import lora_expand, lora_shrink, segment_tiles, tile_tokens
    from conveyor.kernels.paged_decode import paged_decode_attention
    from conveyor.kernels.rms_norm import add_rms_norm_triton
    from conveyor.kernels.rope_kv_store import rope_kv_store
    from conveyor.kernels.silu_mul import silu_mul_triton

    original = JITFunction.run
    JITFunction.run = compile_only_run
    try:
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        for dtype, head_dim, heads, kv_heads, window in (
            (torch.bfloat16, 128, 32, 8, None),
            (torch.float16, 64, 32, 32, None),
            (torch.bfloat16, 256, 16, 2, 4096),
            (torch.bfloat16, 80, 32, 4, None),
            (torch.float32, 96, 8, 1, 64),
            (torch.float32, 256, 8, 2, None),
        ):
            kv = torch.empty(2, 64, 16, kv_heads, head_dim, dtype=dtype)
            tables = torch.zeros(2, 8, dtype=torch.int32)
            scale = head_dim**-0.5
            q = torch.empty(2, heads, head_dim, dtype=dtype)
            qv = torch.empty(8, heads, head_dim, dtype=dtype)  # a speculative verify: 4 query tokens a sequence
            for max_seq_len in (100, 32768):  # one partition (direct) and split-K + reduce
                paged_decode_attention(q, kv, tables, i32([5, 7]), scale, window, max_seq_len=max_seq_len)
                paged_decode_attention(qv, kv, tables, i32([5, 7]), scale, window, max_seq_len=max_seq_len, query_len=4)
            qx = torch.empty(300, heads, head_dim, dtype=dtype)
            for max_query_len in (8, 200):  # short extends get short tiles
                extend_attention(
                    qx,
                    kv,
                    tables,
                    i32([0, 100, 300]),
                    i32([0, 28]),
                    i32([100, 228]),
                    scale,
                    window,
                    max_query_len=max_query_len,
                )
            # Batch-invariant mode's attention: one split and several (and a window's extra one).
            for max_seq_len in (100, 32768):
                invariant_attention(
                    qx, kv, tables, i32([0, 100, 300]), i32([100, 228]), scale, window, max_seq_len=max_seq_len
                )
            kv_store(
                torch.empty(4, kv_heads, head_dim, dtype=dtype),
                torch.empty(4, kv_heads, head_dim, dtype=dtype),
                kv,
                torch.zeros(4, dtype=torch.int64),
            )
            # q, k, v as views of one fused projection output, with and without Qwen3's q/k norm.
            qkv = torch.empty(4, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
            rq, rk, rv = (
                t.view(4, -1, head_dim)
                for t in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            )
            cos_sin = torch.empty(4096, head_dim, dtype=torch.float32)
            positions, slots = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
            norm_weight = torch.empty(head_dim, dtype=dtype)
            rope_kv_store(rq, rk, rv, positions, cos_sin, kv, slots)
            rope_kv_store(rq, rk, rv, positions, cos_sin, kv, slots, norm_weight, norm_weight, 1e-6)
        for dtype, hidden, intermediate in (
            (torch.bfloat16, 2048, 8192),
            (torch.bfloat16, 8192, 28672),
            (torch.float16, 896, 4864),
            (torch.float32, 4096, 14336),
        ):
            x = torch.empty(8, hidden, dtype=dtype)
            add_rms_norm_triton(x, torch.empty_like(x), torch.empty(hidden, dtype=dtype), 1e-5)
            add_rms_norm_triton(x, None, torch.empty(hidden, dtype=dtype), 1e-5)
            silu_mul_triton(torch.empty(8, 2 * intermediate, dtype=dtype))
            invariant_linear(x, torch.empty(intermediate, hidden, dtype=dtype))  # batch-invariant mode
        row_softmax(torch.empty(4, 128256), log=True)
        row_softmax(torch.empty(4, 128256))
        _launch_copy_blocks(torch.empty(2, 8, 16, 8, 128, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64))
        # LoRA: 1B qkv (3 pieces) and 8B gate_up (2) / down (1), decode (split-K) and prefill tiles.
        for dtype, rank, in_features, widths in (
            (torch.bfloat16, 16, 2048, [2048, 512, 512]),
            (torch.bfloat16, 64, 4096, [14336, 14336]),
            (torch.float16, 8, 14336, [4096]),
            (torch.float32, 16, 2048, [2048, 512, 512]),
        ):
            bounds = torch.tensor([[0, w] for w in widths], dtype=torch.int32)
            a = torch.empty(8, len(widths) * rank, in_features, dtype=dtype)
            b = torch.empty(8, sum(widths), len(widths) * rank, dtype=dtype)
            for tokens in (8, 2048):
                block = tile_tokens(tokens)
                token_ids, tiles = (torch.from_numpy(t) for t in segment_tiles(torch.arange(tokens).numpy() % 8, block))
                shrunk = lora_shrink(torch.empty(tokens, in_features, dtype=dtype), a, token_ids, tiles, block)
                lora_expand(
                    shrunk,
                    b,
                    torch.empty(tokens, sum(widths), dtype=dtype),
                    token_ids,
                    tiles,
                    bounds,
                    max(widths),
                    block,
                )
    finally:
        JITFunction.run = original
    return results


def main(argv: list[str] | None = None) -> int:
    """Print one line per compiled variant (or JSON with ``--json``); exit 1 when a variant
    exceeds sm_90 shared memory, 2 when compile-only checking is unavailable here."""
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    reason = available()
    if reason:
        print(f"compile check unavailable: {reason}", file=sys.stderr)
        return 2
    results = compile_all()
    over = [r for r in results if r.shared > SM90_MAX_SHARED]
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in results], default=str))
    else:
        for r in results:
            flags = ("SHARED MEMORY OVER LIMIT " if r in over else "") + ("spills" if r.stack else "")
            print(
                f"{r.kernel:24s} warps={r.num_warps} smem={r.shared:6d} regs={r.registers} stack={r.stack} "
                f"{r.constexprs} {flags}"
            )
        print(f"{len(results)} variants compiled for sm_90, {len(over)} over the shared-memory limit")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
