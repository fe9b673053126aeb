"""Batch-invariant mode (``--batch-invariant``): a request's tokens and log-probabilities are the
same bits whatever else runs in its steps.

Where a CPU forward's bits can move with the batch, and what this mode does about each:

* **Matmuls.** The GEMM a projection calls picks its kernel by the row count: one row is a
  GEMV, a few rows take an edge path, so a token's output changes with its batch mates. Every
  :class:`~conveyor.worker.models.layers.Linear` (and a tied LM head) pads its rows to a
  multiple of :data:`ROW_TILE`, where the kernel's per-row arithmetic no longer depends on the
  count; :func:`make_batch_invariant` checks that on this machine, shape by shape, before the
  server serves (a library that breaks it is a start-up error, not silent drift).
* **Attention.** The batched backend pads a group's keys to its longest member; the mode serves
  with :class:`~conveyor.worker.attention.torch_invariant.TorchInvariantAttention`, whose
  reductions have lengths fixed by the token alone.
* **Row-wise ops** (RMSNorm, softmax, log-softmax, sampling's keyed draws) reduce within a
  row; torch splits such a reduction across threads only for rows far longer than these
  models' hidden sizes; the same start-up check covers the norms.

On CUDA the same three go through Triton kernels whose reduction order is fixed by the row
alone (:mod:`conveyor.kernels.invariant_matmul`, :mod:`~conveyor.kernels.invariant_attention`,
:mod:`~conveyor.kernels.invariant_softmax`, and the model's own per-row RMSNorm kernel); the
start-up check runs there too. docs/batch-invariance.md says where the mode holds and where not.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.torch_invariant import KEY_CHUNK, TorchInvariantAttention, padded_bmm
from conveyor.worker.models.layers import Linear, RMSNorm, linear

#: Rows per GEMM tile in batch-invariant mode: measured on x86 MKL and oneDNN (torch 2.13),
#: row results are the same bits for every row count that is a multiple of 8, and differ
#: between 1, 2, 3 and 5 rows.
ROW_TILE = 8
#: Row counts (and offsets) the start-up check compares a projection's rows across.
_CHECK_SLICES = ((0, 1), (0, 8), (3, 5), (8, 16), (5, 35))


class BatchVarianceError(RuntimeError):
    """This machine's kernels give a row bits that depend on its batch: the mode cannot hold."""


def invariant_backend(
    device: torch.device | str, attention: str, lora: bool = False, tensor_parallel_size: int = 1
) -> AttentionBackend:
    """The attention backend of batch-invariant mode, after checking the mode can run here."""
    kind = torch.device(device).type
    if lora:
        raise ValueError(
            "--batch-invariant does not cover LoRA adapters yet: serve without --lora-modules/--enable-lora"
        )
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--batch-invariant runs on the CPU and on CUDA, not on {kind}: use --device cpu or cuda")
    if kind == "cuda" and tensor_parallel_size > 1:
        raise ValueError(
            "--batch-invariant on CUDA does not cover tensor parallelism (NCCL picks its all-reduce by the "
            "message size, which moves with the batch): serve with --tensor-parallel-size 1"
        )
    if attention not in ("auto", "triton"):
        raise ValueError(f"--batch-invariant brings its own attention: drop --attention {attention}")
    if kind == "cuda" or attention == "triton":  # (triton on a CPU: interpreted, for tests)
        from conveyor.worker.attention.triton_backend import TritonInvariantAttention

        return TritonInvariantAttention()
    return TorchInvariantAttention()


def make_batch_invariant(model: nn.Module) -> None:
    """Pad every projection of ``model`` (and its tied LM head) to :data:`ROW_TILE` rows, then
    check, once per distinct projection, that a row's output is the same bits computed alone
    and among others (BatchVarianceError naming the shape where not)."""
    if getattr(model, "quantization", "none") != "none":
        raise ValueError(
            f"--batch-invariant with quantized weights ({model.quantization}) is not supported: use --quantization none"
        )
    if getattr(getattr(model, "config", None), "moe", None) is not None:
        raise ValueError(
            "--batch-invariant does not cover mixture-of-experts models yet (expert groups change with the batch)"
        )
    checked: set[tuple] = set()
    generator = torch.Generator(device="cpu").manual_seed(0)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm) and ("norm", module.weight.shape) not in checked:
            checked.add(("norm", module.weight.shape))
            _check_rows(name, module, module.weight, generator)
        if not isinstance(module, Linear):
            continue
        module.row_tile = ROW_TILE
        key = (tuple(module.weight.shape), module.packed is not None, module.bias is not None)
        if key not in checked:
            checked.add(key)
            _check_rows(name, lambda x, m=module: m.matmul(x, m.bias), module.weight, generator)
    # (CUDA's attention kernel is checked by tests and bench/gpu_checks, not at start-up: these
    # are the CPU backend's products.)
    cpu = next(model.parameters()).device.type == "cpu"
    for head_dim in (
        sorted({layer.head_dim for layer in model.attention_layers()})
        if cpu and hasattr(model, "attention_layers")
        else ()
    ):
        _check_attention_products(head_dim, generator)
    if hasattr(model, "row_tile") and getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        model.row_tile = ROW_TILE
        weight, packed = model.embed_tokens.weight, getattr(model, "tied_head_packed", None)
        _check_rows("lm_head (tied)", lambda x: linear(x, weight, None, packed, ROW_TILE), weight, generator)


def _check_rows(name: str, project, weight: torch.Tensor, generator: torch.Generator) -> None:
    in_features, dtype = weight.shape[-1], weight.dtype
    rows = max(start + count for start, count in _CHECK_SLICES)
    x = torch.randn(rows, in_features, generator=generator).to(weight.device, dtype)
    with torch.inference_mode():
        together = project(x)
        for start, count in _CHECK_SLICES:
            alone = project(x[start : start + count])
            if not torch.equal(alone, together[start : start + count]):
                raise BatchVarianceError(
                    f"--batch-invariant: {name} ({in_features} inputs) gives rows {start}..{start + count - 1} "
                    f"other bits in a batch of {rows} than in one of {count} on this machine's matmul"
                )


def _check_attention_products(head_dim: int, generator: torch.Generator) -> None:
    """The attention's two products (scores over ``head_dim``, weighted values over a key
    chunk): a row's bits the same in any row count and beside any batch entries."""
    for inner, outer in ((head_dim, KEY_CHUNK), (KEY_CHUNK, head_dim)):
        a = torch.randn(6, 40, inner, generator=generator)
        b = torch.randn(6, inner, outer, generator=generator)
        together = padded_bmm(a, b)
        for start, count in _CHECK_SLICES:
            if not torch.equal(padded_bmm(a[1:3, start : start + count], b[1:3]), together[1:3, start : start + count]):
                raise BatchVarianceError(
                    f"--batch-invariant: the attention's {inner}-long products give rows {start}..{start + count - 1} "
                    "other bits beside other rows on this machine's matmul"
                )
