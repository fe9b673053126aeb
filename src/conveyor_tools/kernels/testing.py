"""Input builders, comparison rules and the paged attention reference shared by the kernel tests
and the benchmark.

Paged inputs are made to look like a real, fragmented pool: every sequence gets distinct blocks
drawn at random from a pool larger than needed, in shuffled order, and the unused tail of each
block-table row points at other random (valid) blocks, so a kernel that reads past a sequence's
end or ignores the table gets wrong numbers rather than lucky ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.12

__all__ = [
    "ROUNDED_TOLERANCES",
    "ROW_CASES",
    "TOLERANCES",
    "AttentionCase",
    "Draw",
    "assert_attention_close",
    "assert_close",
    "paged_attention_ref",
    "random_block_tables",
    "random_kv_cache",
    "random_paged_kv",
    "random_query",
]

#: ``dtype -> (rtol, atol)`` for attention outputs, checked elementwise as
#: ``|out - ref| <= atol + rtol * |ref|`` against a float32 reference fed the same
#: (already rounded) inputs. Outputs are convex combinations of V rows drawn from N(0, 1), so the
#: absolute floor is relative to that unit scale; it only matters for outputs near zero.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}


#: ``dtype -> (rtol, atol)`` for the elementwise and normalization kernels (:mod:`.rms_norm`,
#: :mod:`.silu_mul`, :mod:`.rope_kv_store`), whose references round to the input dtype at the
#: same points as the kernel. float32 differs only in reduction order and fused multiply-adds.
#: Half precision allows a few units in the last place through chains of up to three roundings:
#: Triton's interpreter converts to bfloat16 by truncation where a GPU rounds to nearest, which
#: costs up to one bfloat16 ulp (2**-7 relative) per rounding point.
ROUNDED_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

#: ``(rows, width, dtype)`` inputs of the row-wise kernels' tests (:mod:`.rms_norm`, whose block
#: is the whole row, and :mod:`.silu_mul`, tiled by 1024 columns): widths under, at and over one
#: column tile, powers of two and not (masked tails), every dtype.
ROW_CASES: list[tuple[int, int, torch.dtype]] = [
    (1, 64, torch.float32),
    (7, 96, torch.float32),
    (5, 1024, torch.float32),
    (3, 1500, torch.float32),
    (3, 2048, torch.float32),
    (5, 80, torch.bfloat16),
    (2, 2100, torch.bfloat16),
    (4, 256, torch.float16),
]


class Draw(TypedDict):
    """How every random tensor here is drawn (keyword arguments of the builders): N(0, 1) on
    the CPU from ``generator``, so every device sees the same numbers, then moved to
    ``device`` in ``dtype``."""

    dtype: torch.dtype
    device: torch.device | str
    generator: torch.Generator


def _randn(shape: tuple[int, ...], draw: Draw) -> torch.Tensor:
    return torch.randn(shape, generator=draw["generator"]).to(device=draw["device"], dtype=draw["dtype"])


def random_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, **draw: Unpack[Draw]
) -> torch.Tensor:
    """A layer cache ``[2, num_blocks, block_size, kv_heads, head_dim]`` of N(0, 1) values."""
    return _randn((2, num_blocks, block_size, num_kv_heads, head_dim), draw)


def random_block_tables(
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    *,
    generator: torch.Generator,
    device: torch.device | str,
    extra_columns: int = 1,
) -> torch.Tensor:
    """``[B, max_blocks]`` int32 tables giving each sequence distinct random blocks of the pool.

    Raises if the pool is too small. Unused entries hold random valid block ids.
    """
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"pool of {num_blocks} blocks cannot hold {sum(needed)}")
    width = max(needed, default=0) + extra_columns
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=generator)
    taken = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[taken : taken + n]
        taken += n
    return table.to(device=device, dtype=torch.int32)


def random_paged_kv(
    seq_lens: Sequence[int], block_size: int, num_kv_heads: int, head_dim: int, **draw: Unpack[Draw]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer cache and block tables for ``seq_lens``: the pool holds about twice the blocks the
    sequences need, so tables are scattered over it and unused blocks hold other numbers."""
    needed = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = 2 * needed + 5
    kv = random_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, **draw)
    return kv, random_block_tables(seq_lens, block_size, num_blocks, generator=draw["generator"], device=draw["device"])


def random_query(
    num_tokens: int, num_heads: int, head_dim: int, *, strided: bool = False, **draw: Unpack[Draw]
) -> torch.Tensor:
    """``[num_tokens, num_heads, head_dim]`` N(0, 1) queries; ``strided``: a slice of a wider,
    fused projection (token stride > heads * head_dim), as a merged q/k/v output gives."""
    if not strided:
        return _randn((num_tokens, num_heads, head_dim), draw)
    fused = _randn((num_tokens, num_heads + 3, head_dim), draw)
    query = fused[:, 1 : num_heads + 1]
    assert not query.is_contiguous()
    return query


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The head layout, paging, dtype and window of one paged attention test: what the decode
    and the extend tests vary alike, and build their random inputs from."""

    head_dim: int
    ratio: int  # query heads per KV head
    block_size: int
    num_kv_heads: int = 2
    dtype: torch.dtype = torch.float32
    window: int | None = None

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def inputs(
        self,
        seq_lens: Sequence[int],
        num_tokens: int,
        *,
        device: torch.device | str,
        generator: torch.Generator,
        strided_query: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query, kv, block_tables)``: ``num_tokens`` random query rows of every head and a
        cache paging ``seq_lens`` (drawn cache first, so a case's numbers never depend on the
        query's layout)."""
        draw = Draw(dtype=self.dtype, device=device, generator=generator)
        kv, tables = random_paged_kv(seq_lens, self.block_size, self.num_kv_heads, self.head_dim, **draw)
        num_heads = self.num_kv_heads * self.ratio
        return random_query(num_tokens, num_heads, self.head_dim, strided=strided_query, **draw), kv, tables


def paged_attention_ref(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The float32 oracle of the paged attention kernels (extend and decode alike): sequence
    ``b`` has ``spans[b] = (context_len, new_tokens)``, its new tokens are the next
    ``new_tokens`` rows of ``query`` and new token ``i`` attends to positions
    ``[0, context_len + i]`` (the last ``sliding_window`` of them), read through
    ``block_tables[b]`` position by position. Returns ``[T, heads, head_dim]`` float32."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // kv.shape[3]
    block_size = kv.shape[2]
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device)
    start = 0
    for b, (context_len, new_tokens) in enumerate(spans):
        end, length = start + new_tokens, context_len + new_tokens
        positions = torch.arange(length, device=kv.device)
        blocks = block_tables[b].to(device=kv.device, dtype=torch.long)[positions // block_size]
        k, v = (kv[i, blocks, positions % block_size].float().repeat_interleave(group, dim=1) for i in (0, 1))
        scores = torch.einsum("nhd,lhd->hnl", query[start:end].float(), k) * scale
        q_pos = context_len + torch.arange(new_tokens, device=query.device)[:, None]
        visible = positions[None, :] <= q_pos
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
        start = end
    assert start == num_tokens, f"spans hold {start} new tokens, query {num_tokens}"
    return out


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Fail on any NaN/inf in ``out`` or any element outside :data:`TOLERANCES` for ``dtype``
    (default ``out.dtype``), naming the worst element."""
    assert_close(out, ref, TOLERANCES[dtype or out.dtype])


def assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance: tuple[float, float]) -> None:
    """Fail on any NaN/inf in ``out`` or any element with ``|out - ref| > atol + rtol * |ref|``
    for ``tolerance = (rtol, atol)``, naming the worst element."""
    rtol, atol = tolerance
    got = out.detach().to(device="cpu", dtype=torch.float32)
    want = ref.detach().to(device="cpu", dtype=torch.float32)
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    bad = ~torch.isfinite(got)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} non-finite outputs, first at {first}")
    err = (got - want).abs()
    excess = err - (atol + rtol * want.abs())
    if (excess > 0).any():
        worst = tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
        raise AssertionError(
            f"{int((excess > 0).sum())}/{excess.numel()} elements outside rtol={rtol}, atol={atol}; "
            f"worst at {worst}: got {got[worst].item():.6g}, want {want[worst].item():.6g}"
        )
