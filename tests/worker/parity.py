"""Greedy parity with HF transformers that a half-precision run can pass honestly.

In float32 two correct implementations agree token for token, and the tests demand it. In
bfloat16 they do not: each rounds differently (reduction order, fused kernels), and where HF's
own top two logits are closer than that rounding noise, either token is a correct greedy pick.
Asserting token equality there fails on ties, not bugs (issue 15: the bf16 qwen3 case failed at
token 6, where HF's top-2 margin was one bf16 ulp). So a half-precision run is compared token
by token, and a divergence is excused only at a step where HF's margin is below the dtype's
resolution and our token is one of HF's tied candidates; comparison stops there, because the
two continuations no longer share a prefix. A divergence at a clear margin still fails, and so
does one before ``min_compared`` tokens agreed: a run that reaches a tie at once tested nothing.

Resolution: a bf16 forward's logits deviate from the float32 forward's by up to about 7 units
of ``|top logit| * 2**-8`` at the top two (measured on the tests' tiny checkpoints: median 1.4,
90th percentile 2.9, max 7.1), so two bf16 implementations can swap the top two when HF's
margin is under ~8 such units: :data:`RELATIVE_RESOLUTION` is ``8 * 2**-8`` for bfloat16 and
the same 8 units of float16's finer ``2**-11``. float32 gets 0: every token must match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: dtype -> margin below which HF's top two logits count as tied, relative to the top logit.
RELATIVE_RESOLUTION: dict[torch.dtype, float] = {
    torch.float32: 0.0,
    torch.bfloat16: 8 * 2.0**-8,
    torch.float16: 8 * 2.0**-11,
}


def assert_greedy_agrees(
    ours: Sequence[int],
    reference: Sequence[int],
    reference_logits: torch.Tensor,
    dtype: torch.dtype,
    *,
    min_compared: int,
    label: str = "",
) -> int:
    """Check our greedy tokens against HF's; return how many were compared equal.

    ``reference_logits`` is ``[len(reference), vocab]``: HF's logits at each generated step
    (row ``i`` produced ``reference[i]``). Tokens must be equal up to the first divergence; a
    divergence passes only at a near-tie of HF's logits (margin below
    :data:`RELATIVE_RESOLUTION` of ``dtype`` times the top logit's magnitude) where our token
    is within that margin of HF's top logit, and only after at least ``min_compared`` tokens.
    """
    if len(ours) != len(reference) or reference_logits.shape[0] != len(reference):
        raise AssertionError(f"{label}: {len(ours)} tokens of ours, {len(reference)} of HF's, "
                             f"{reference_logits.shape[0]} logit rows")
    resolution = RELATIVE_RESOLUTION[dtype]
    logits = reference_logits.detach().to(device="cpu", dtype=torch.float32)
    for step, (got, want) in enumerate(zip(ours, reference)):
        if got == want:
            continue
        row = logits[step]
        top2 = row.topk(2).values
        tie_within = resolution * float(top2[0].abs())
        margin = float(top2[0] - top2[1])
        ours_behind = float(top2[0] - row[got])
        where = f"{label}: token {step}: ours {got}, HF {want}"
        if margin >= tie_within or ours_behind > tie_within:
            raise AssertionError(
                f"{where}; HF's margin {margin:.4g} and our token's distance {ours_behind:.4g} from its top "
                f"logit {float(top2[0]):.4g}: not a tie within {tie_within:.3g} ({dtype}); ours {list(ours)}, "
                f"HF {list(reference)}"
            )
        if step < min_compared:
            raise AssertionError(f"{where} at a tie, but only {step} tokens agreed before it (at least "
                                 f"{min_compared} must, or the run tested nothing): pick other prompts")
        return step
    return len(reference)


def hf_greedy_with_logits(
    model: torch.nn.Module, prompt: Sequence[int], max_new: int
) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of ``prompt`` (on the model's device, EOS never stopping it)
    and its float32 logits at each generated step, ``[max_new, vocab]``."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()
