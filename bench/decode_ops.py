#!/usr/bin/env python3
"""Torch operators per decoder layer in one CPU decode step (a script, not a test).

Every aten operator is a kernel launch on a GPU and a dispatch through torch's C++ and, for
many, an allocation on a CPU; a decode step of a small batch costs about that count times
the per-operator overhead. This builds a small Llama (or Qwen3, with per-head q/k RMSNorm)
checkpoint with the 1B-class config's layer structure (grouped kv heads, fused q/k/v and
gate/up at load time) but tiny widths, prefills ``--batch`` sequences through
:class:`~conveyor.worker.model_runner.ModelRunner` on the CPU, then runs one decode step
under a ``TorchDispatchMode`` that counts every aten operator, attributed to the decoder
layer that issued it (forward hooks mark the layers) or to "outside layers" (embedding,
final norm, LM head, sampling, the runner's input tensors). "Per layer" is a layer after the
first; layer 0 is reported apart (it also builds the step's per-step attention tensors).
The dispatch count sees a composite operator (``rms_norm``) as one; a second decode step under
``torch.profiler`` counts the leaf aten operators of one layer, which is what actually runs.

A third decode step takes the CUDA code path on the CPU: the Triton attention backend and the
fused layer kernels (forced on, interpreted), and counts what would be a device launch per
layer: each Triton kernel launch plus each aten operator that is neither a view, an
allocation nor a cast or reshape that returned its input's storage (operators the interpreter
itself issues are not counted).

    python bench/decode_ops.py                       # llama and qwen3, batch 1 and 8
    python bench/decode_ops.py --label before --out bench/results/decode-ops-cpu.json
    python bench/decode_ops.py --dtype bfloat16 --batches 1   # the GPU baseline's dtype

``--out`` merges this run's figures under ``--label`` into the JSON file, so a before and an
after run sit side by side in one file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# The CUDA-path count runs the Triton kernels through the interpreter; it must be chosen before
# anything imports Triton. The CPU path never runs Triton, so this changes nothing there.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

from conveyor.ipc.messages import CachedRequests, NewRequestData, SamplingParams, StepPlan  # noqa: E402
from conveyor.runtime.config import RunnerConfig  # noqa: E402
from conveyor.worker.model_runner import ModelRunner  # noqa: E402

try:  # absent from trees before the fused layer ops, whose CUDA path is the Triton backend alone
    from conveyor.kernels import layer_ops
except ImportError:
    layer_ops = None

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
PROMPT = 12
BLOCKS_PER_REQUEST = 4
#: The 1B config's layer structure (32 query heads over 8 kv heads, head_dim 64) at small widths.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=256,
)
MODELS = {"llama": (LlamaConfig, "LlamaForCausalLM"), "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}


#: Operators that return views of their input (no kernel, no allocation of data) besides
#: those whose schema says so (``OpOverload.is_view``): the multi-output splits.
SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}
#: Operators that only make tensor metadata, views or uninitialised storage (no element work),
#: or are no-ops here (``to``/``type_as`` to the tensor's own dtype return it unchanged).
METADATA_LEAVES = {
    "as_strided",
    "as_strided_",
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "transpose",
    "t",
    "permute",
    "expand",
    "alias",
    "detach",
    "narrow",
    "flatten",
    "unflatten",
    "chunk",
    "split",
    "split_with_sizes",
    "unbind",
    "resolve_conj",
    "resolve_neg",
    "result_type",
    "empty",
    "empty_strided",
    "empty_like",
    "to",
    "type_as",
    "lift_fresh",
}


#: Operators that return their input (or a view of it) when it already has the asked-for
#: dtype/layout, and a copy otherwise: a launch only in the second case.
MAYBE_COPIES = {"to", "type_as", "contiguous", "reshape"}
#: Operators that allocate without a kernel.
ALLOCATIONS = {"empty", "empty_like", "empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts aten operators into the bucket :attr:`where` names at the time of the call."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "outside layers"
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.views: set[str] = set()
        self.copies: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.paused = False  # inside an interpreted Triton kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        if self.paused or name.startswith("_record_function"):  # the interpreter's, this script's markers
            return out
        if func.is_view or name in SPLITS:
            self.views.add(name)
        if name in MAYBE_COPIES and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
            self.copies[self.where][name] += 1
        self.counts[self.where][name] += 1
        return out

    def count_triton_launches(self) -> None:
        """Count each interpreted Triton launch as ``triton <kernel>``; pause op counting inside."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):  # noqa: ANN001, ANN202
            counter.counts[counter.where][f"triton {fn.fn.__name__}"] += 1
            counter.paused = True
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter.paused = False

        InterpretedFunction.run = run


def _leaf_ops(prof: torch.profiler.profile, mark: str) -> collections.Counter[str]:
    """The innermost aten operators doing element work under the profiler range ``mark``: each
    operator not in :data:`METADATA_LEAVES` that has no such operator inside it. This is what
    actually runs, where the dispatch count sees a composite operator (``rms_norm``) as one."""
    counts: collections.Counter[str] = collections.Counter()

    def walk(event) -> int:  # noqa: ANN001  (a profiler FunctionEvent; returns ops counted under it)
        below = sum(walk(child) for child in event.cpu_children)
        name = event.name.removeprefix("aten::")
        if below == 0 and event.name.startswith("aten::") and name not in METADATA_LEAVES:
            counts[name] += 1
            return 1
        return below

    (root,) = [e for e in prof.events() if e.name == mark]
    walk(root)
    return counts


def build_checkpoint(model: str, directory: Path) -> None:
    config_class, architecture = MODELS[model]
    config = config_class(**SHAPE, architectures=[architecture])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def prefilled_runner(model: str, batch: int, attention: str, dtype: str) -> ModelRunner:
    """A runner on the CPU holding ``batch`` sequences whose prompts are prefilled (step 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(model, Path(tmp))
        runner = ModelRunner(
            RunnerConfig(
                tmp,
                block_size=BLOCK_SIZE,
                num_blocks=batch * BLOCKS_PER_REQUEST + 1,
                dtype=dtype,
                attention=attention,
            ),
        )
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    news = [
        NewRequestData(
            f"r{i}",
            i,
            [3 + i] * PROMPT,
            greedy,
            list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)),
            0,
            PROMPT,
        )
        for i in range(batch)
    ]
    runner.execute(StepPlan(1, news, CachedRequests(), []))
    return runner


def decode_plan(step: int, batch: int) -> StepPlan:
    """Decode step ``step`` (2, 3, ...) of every sequence of :func:`prefilled_runner`."""
    return StepPlan(step, [], CachedRequests(list(range(batch)), [PROMPT + step - 2] * batch, [1] * batch), [])


def count_cuda_path(model: str, batch: int, dtype: str) -> dict[str, Any]:
    """Device launches per layer of the CUDA code path, run on the CPU with Triton interpreted."""
    if layer_ops is not None:
        forced = layer_ops._use_triton
        layer_ops._use_triton = lambda x: True
    try:
        runner = prefilled_runner(model, batch, "triton", dtype)
        counter = OpCounter()
        counter.count_triton_launches()
        for i, layer in enumerate(runner.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: setattr(counter, "where", f"layer {i}"))
            layer.register_forward_hook(lambda *_: setattr(counter, "where", "outside layers"))
        with counter:
            runner.execute(decode_plan(2, batch))
    finally:
        if layer_ops is not None:
            layer_ops._use_triton = forced
    layer = counter.counts["layer 1"]
    launches = collections.Counter(
        {op: n for op, n in layer.items() if op not in counter.views | ALLOCATIONS | MAYBE_COPIES}
    )
    launches.update(counter.copies["layer 1"])
    return {"launches_per_layer": sum(launches.values()), "layer_launches": dict(launches.most_common())}


def count_decode_step(model: str, batch: int, dtype: str) -> dict[str, Any]:
    runner = prefilled_runner(model, batch, "auto", dtype)
    decode = decode_plan(2, batch)
    counter = OpCounter()
    layers = list(runner.model.layers)
    marks: list[torch.autograd.profiler.record_function] = []

    def enter(i: int) -> None:
        counter.where = f"layer {i}"
        marks.append(torch.autograd.profiler.record_function(f"decode_ops layer {i}"))
        marks[-1].__enter__()

    def leave() -> None:
        counter.where = "outside layers"
        marks.pop().__exit__(None, None, None)

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: enter(i)))
        hooks.append(layer.register_forward_hook(lambda *_: leave()))
    with counter:
        runner.execute(decode)
    decode = decode_plan(3, batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.execute(decode)
    for hook in hooks:
        hook.remove()
    leaves = _leaf_ops(prof, "decode_ops layer 1")
    per_layer = [sum(counter.counts[f"layer {i}"].values()) for i in range(len(layers))]
    layer = counter.counts["layer 1"]
    # Layer 0 differs: it starts the residual stream, and attention backends build per-step
    # tensors there (once per step, reused by the later layers). Every later layer is the same.
    assert len(set(per_layer[1:])) == 1, f"layers issued different operator counts: {per_layer}"
    return {
        "ops_per_layer": per_layer[1],
        "compute_ops_per_layer": sum(n for op, n in layer.items() if op not in counter.views),
        "ops_first_layer": per_layer[0],
        "ops_outside_layers": sum(counter.counts["outside layers"].values()),
        "ops_per_step": sum(sum(c.values()) for c in counter.counts.values()),
        "layer_ops": dict(layer.most_common()),
        "leaf_ops_per_layer": sum(leaves.values()),
        "layer_leaf_ops": dict(leaves.most_common()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16 adds the casts the GPU baseline ran (its 1B model was bf16)",
    )
    p.add_argument("--label", default="current", help="key of this run's figures in --out")
    p.add_argument("--out", type=Path, help="JSON file to merge this run's figures into")
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for model in args.models:
        for batch in args.batches:
            r = count_decode_step(model, batch, args.dtype)
            r.update(count_cuda_path(model, batch, args.dtype))
            results[f"{model} batch {batch}"] = r
            print(
                f"{model:6s} batch {batch:3d}: {r['ops_per_layer']:3d} ops per layer "
                f"({r['compute_ops_per_layer']} not views), "
                f"{r['ops_first_layer']:3d} in layer 0, {r['ops_outside_layers']:3d} outside layers, "
                f"{r['ops_per_step']:4d} per step"
            )
            print("    one layer: " + ", ".join(f"{op} x{n}" for op, n in r["layer_ops"].items()))
            print(
                f"    {r['leaf_ops_per_layer']} leaf operators doing element work (profiler): "
                + ", ".join(f"{op} x{n}" for op, n in r["layer_leaf_ops"].items())
            )
            print(
                f"    CUDA path: {r['launches_per_layer']} launches per layer: "
                + ", ".join(f"{op} x{n}" for op, n in r["layer_launches"].items())
            )
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        merged[args.label] = {
            "config": {**SHAPE, "block_size": BLOCK_SIZE, "prompt": PROMPT, "dtype": args.dtype, "device": "cpu"},
            "versions": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "commit": commit.stdout.strip(),
            },
            "results": results,
        }
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
