"""Triton kernels of the worker, each beside a plain-torch float32 reference.

- :mod:`.kv_store`: write new tokens' K/V into their cache slots (``-1`` = skip).
- :mod:`.paged_decode`: one query token per sequence over the paged cache; GQA-grouped,
  split-K with a reduce kernel for long contexts.
- :mod:`.extend_attention`: prefill, chunked prefill and prefix reuse for a ragged batch.
- :mod:`.block_copy`: copy-on-write block copies in one cache; batched swaps between caches.
- :mod:`.rms_norm`: residual add + RMSNorm in one pass (the residual stream updated in place).
- :mod:`.rope_kv_store`: rotary embedding (after Qwen3's per-head q/k norm) fused with the KV store.
- :mod:`.silu_mul`: the gated MLP's ``silu(gate) * up`` in one pass.
- :mod:`.lora`: many LoRA adapters' deltas over one step's tokens (segment shrink + expand).
- :mod:`.layer_ops`: what the model calls for norms and the MLP activation: those kernels on
  CUDA, torch's ops elsewhere (imports Triton only on the first CUDA call).

Test inputs, tolerances and the sm_90 compile check are tools, in :mod:`conveyor_tools.kernels`.

Submodules are imported explicitly (``from conveyor.kernels.paged_decode import ...``) and this
package imports none of them, so importing it never imports Triton: the interpreter switch
``TRITON_INTERPRET`` is read when kernels are decorated, and must be set before that.
"""
