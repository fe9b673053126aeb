"""The stages bench/gpu_checks.py runs, in the order of what they teach (docs/benchmarks.md,
"What the GPU owes"), each with its GPU limit and its dry run's (``--cpu``) arguments.

A device session has 15 minutes in all, a machine's start included, and a second call rarely
finds the machine still warm, so **the first window (window 1) must deliver**: after the
preflight, the checkpoint and a smoke stage under 60 s (the decode step at batch 1 and 128,
graphs == eager), then Conveyor's throughput, HF padded, the decode-step grid and the GPU
tests; their limits add up to the default 420 s deadline, and the rest of window 1 runs in
what the early stages leave unused. Window 2 holds what cannot fit a first window at all:
compiled HF (a cold ``torch.compile`` of 16 layers takes minutes), for a later call.

stdlib only: the driver must run where a package it checks for is missing.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every --cpu stage's limit: it only bounds a hung stage (the dry run's deadline is the sum),
# and on two shared, loaded cores a bin/serve start or a torch import alone can take 15 s.
CPU_LIMIT_S = 60
SPEC_TESTS = "tests/engine/test_verify_step_graphs.py"  # the spec_tests stage's, not gpu_tests'
#: Modules the device image lacks that no GPU test may need at import (pytest.importorskip in a
#: test that does): the --cpu gpu_tests stage collects with them made unimportable.
HTTP_CLIENTS = ("openai", "jsonschema")
WINDOWS = (1, 2)


@dataclass
class Stage:
    name: str
    limit_s: int
    command: list[str]
    outputs: list[str] = field(default_factory=list)  # result files the summary reads
    window: int = 1
    env: dict[str, str] = field(default_factory=dict)  # added to the driver's environment
    # Why --cpu skips it: its command is another stage's at another setting, or tests the suite
    # runs itself (the dry run checks each command once: each stage starts its own processes,
    # seconds of CPU apiece, and CI pays for them); empty: the dry run runs it.
    cpu_skip: str = ""


def gpu_test_files() -> list[str]:
    """The test files with gpu marks, but the kernels' and the spec_tests stage's (their own
    stages): passed by name, so no other module (those needing openai or jsonschema, which
    the device image lacks) is ever collected."""
    files = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("tests/kernels/") or rel == SPEC_TESTS:
            continue
        if "pytest.mark.gpu" in path.read_text(errors="replace"):
            files.append(rel)
    return files


def unimportable(folder: Path, names: tuple[str, ...]) -> str:
    """A folder that, first on PYTHONPATH, makes each of ``names`` fail to import as on the device."""
    for name in names:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not on the device image (bench/gpu_checks.py --cpu hides it)')\n"
        )
    return str(folder)


def stages(cpu: bool, results: Path, checkpoint: Path, work: Path) -> list[Stage]:
    """Window 1 in its order, then window 2 (docs/benchmarks.md, "What the GPU owes")."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    device = ["--device", "cpu", "--dtype", "float32"] if cpu else ["--device", "cuda", "--dtype", "bfloat16"]
    common = [
        py,
        str(REPO / "bin" / "bench"),
        "offline",
        "--model",
        str(checkpoint),
        *device,
        "--kv-cache-memory",
        "0.05" if cpu else "20",
        "--no-progress",
        "--workload",
        "fixed",
    ]
    if cpu:
        common += ["--threads", "1"]
    plen, olen = ("16", "8") if cpu else ("128", "128")

    def limit(gpu_limit: int) -> int:
        return CPU_LIMIT_S if cpu else gpu_limit

    def bench(
        name: str, systems: str, batch: int, requests: int, gpu_limit: int, window: int = 1, cpu_skip: str = ""
    ) -> Stage:
        json_path = str(results / f"{name}.json")
        timeout = str(max(10, limit(gpu_limit) - 10))  # a silent server fails the call before the stage's limit
        cmd = [
            *common,
            "--systems",
            systems,
            "--batch-size",
            str(batch),
            "--num-requests",
            str(requests),
            "--prompt-len",
            plen,
            "--output-len",
            olen,
            "--timeout",
            timeout,
            "--json",
            json_path,
        ]
        if systems == "conveyor":  # warmed on the workload's own shapes; the second timed window reported
            cmd += ["--warmup", "workload", "--timed-runs", "2"]
        return Stage(name, limit(gpu_limit), cmd, [json_path], window, cpu_skip=cpu_skip)

    out = [
        Stage(
            "checkpoint",
            limit(40),
            [py, str(REPO / "bench" / "gpu_checks.py"), "checkpoint", str(checkpoint), *(["--tiny"] if cpu else [])],
        )
    ]
    smoke_json = str(results / "smoke.json")
    smoke_args = (
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batches",
            "1,4",
            "--context",
            "32",
            "--steps",
            "2",
            "--prompt-lens",
            "3,16,100",
            "--new-tokens",
            "4",
            "--threads",
            "1",
        ]
        if cpu
        else []
    )
    out.append(
        Stage(
            "smoke",
            limit(60),
            [
                py,
                str(REPO / "bench" / "gpu_smoke.py"),
                "--checkpoint",
                str(checkpoint),
                *smoke_args,
                "--out",
                smoke_json,
            ],
            [smoke_json],
        )
    )
    out.append(bench("conveyor_b128", "conveyor", 4 if cpu else 128, 8 if cpu else 256, 90))
    # The baseline the throughput target is stated against (issue 24: >= 20x padded HF generate).
    out.append(bench("hf", "hf", 4 if cpu else 128, 8 if cpu else 256, 50))
    grid = (
        ["--batches", "1", "--contexts", "32", "--steps", "2"]
        if cpu
        else ["--batches", "1,32,128", "--contexts", "512,2048", "--steps", "10"]
    )
    step_json = str(results / "decode_step.json")
    out.append(
        Stage(
            "decode_step",
            limit(60),
            [
                py,
                str(REPO / "bench" / "decode_step.py"),
                "--checkpoint",
                str(checkpoint),
                *(["--device", "cpu", "--dtype", "float32"] if cpu else []),
                *grid,
                "--out",
                step_json,
            ],
            [step_json],
        )
    )
    # Graphs == eager at long contexts, HF parity, swaps, LoRA against PEFT, NCCL where two GPUs exist.
    hide = {"PYTHONPATH": unimportable(work / "hidden-modules", HTTP_CLIENTS)} if cpu else {}
    out.append(Stage("gpu_tests", limit(90), [*pytest, "-m", "gpu", *gpu_test_files()], env=hide))
    # Batch-invariant mode on CUDA (issue 42): its Triton kernels have never run compiled; a
    # request's bits alone and beside 8 and 32 others (mode on: equal, or the stage fails), and
    # the mode's cost on against off (docs/batch-invariance.md).
    invariance_json = str(results / "batch_invariance.json")
    out.append(
        Stage(
            "batch_invariance",
            limit(90),
            [
                py,
                str(REPO / "bench" / "batch_invariance.py"),
                "--checkpoint",
                str(checkpoint),
                *(["--cpu"] if cpu else []),
                "--out",
                invariance_json,
            ],
            [invariance_json],
        )
    )
    # The rest of window 1, in what the stages above leave unused.
    out.append(bench("conveyor_b1", "conveyor", 1, 2 if cpu else 4, 40, cpu_skip="conveyor_b128's command at batch 1"))
    out.append(
        bench(
            "conveyor_b8",
            "conveyor",
            2 if cpu else 8,
            4 if cpu else 16,
            40,
            cpu_skip="conveyor_b128's command at batch 8",
        )
    )
    # conveyor-sim's cost model, fitted to the three runs' per-step records (three batch sizes,
    # so the per-sequence cost is told apart from the per-step floor); seconds, no device. The
    # dry run has conveyor_b128's alone.
    cost_json = str(results / "sim_cost.json")
    runs = [str(results / f"conveyor_{b}.json") for b in (("b128",) if cpu else ("b128", "b1", "b8"))]
    out.append(
        Stage(
            "sim_calibrate",
            limit(20),
            [py, str(REPO / "bin" / "sim"), "calibrate", *runs, "--out", cost_json],
            [cost_json],
        )
    )
    # Structured output (issue 27): conveyor_b128's batch with half its requests under a JSON
    # schema; its throughput over conveyor_b128's is the figure owed (target >= 0.9x).
    half = bench("conveyor_b128_json_half", "conveyor", 4 if cpu else 128, 8 if cpu else 256, 60)
    half.command.extend(["--constrained-fraction", "0.5"])
    out.append(half)
    # Speculative verify steps through the static buffers (issue 28): their graphs == eager
    # tests, then plain / ragged-verify / static-verify decoding side by side (bench/speculative.py).
    out.append(
        Stage(
            "spec_tests",
            limit(60),
            [*pytest, "-m", "gpu", SPEC_TESTS],
            cpu_skip="its tests need CUDA, and the suite collects the file itself",
        )
    )
    spec_json = str(results / "speculative.json")
    spec_args = (
        ["--smoke", "--threads", "1"]
        if cpu
        else [
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--requests",
            "8",
            "--prompt-len",
            "256",
            "--max-tokens",
            "64",
            "--kv-cache-memory",
            "20",
        ]
    )
    out.append(
        Stage(
            "speculative",
            limit(75),
            [
                py,
                str(REPO / "bench" / "speculative.py"),
                "--checkpoint",
                str(checkpoint),
                *spec_args,
                "--out",
                spec_json,
            ],
            [spec_json],
        )
    )
    kernels = [*pytest, "tests/kernels/test_block_copy.py" if cpu else "tests/kernels"]
    if not cpu:
        kernels += ["-n", "8"] if has_xdist() else []
    out.append(Stage("kernels", limit(60), kernels, cpu_skip="the suite runs tests/kernels itself, interpreted"))
    # Mixture of experts (issue 40): the fused MoE layer against the dense MLP of equal active
    # parameters at Qwen3-30B-A3B's shapes (target: within 1.3x at batch 64); its kernel tests
    # ran compiled in the kernels stage.
    moe_json = str(results / "moe.json")
    out.append(
        Stage(
            "moe",
            limit(45),
            [py, str(REPO / "bench" / "moe_layer.py"), *(["--cpu"] if cpu else []), "--out", moe_json],
            [moe_json],
        )
    )
    # LoRA: the Triton kernels' tests (compiled; the gpu-marked bf16 one at 1B shapes), then 8
    # adapters over the requests against the base model alone (docs/benchmarks.md); the
    # gpu-marked parity tests against PEFT run in gpu_tests. The bench runs even when a test
    # fails; either fails the stage.
    lora_json = str(results / "lora.json")
    lora_args = (
        ["--requests", "4", "--adapters", "2", "--prompt-len", "8", "--max-tokens", "4", "--repeats", "1"]
        if cpu
        else ["--device", "cuda", "--dtype", "bfloat16"]
    )
    lora_tests = [*pytest, *(["-m", "gpu"] if cpu else []), "tests/kernels/test_lora.py"]
    lora_bench = [py, str(REPO / "bench" / "lora.py"), *lora_args, "--out", lora_json]
    out.append(
        Stage(
            "lora",
            limit(90),
            ["sh", "-c", f"{shlex.join(lora_tests)}; tests=$?; {shlex.join(lora_bench)} && exit $tests"],
            [lora_json],
        )
    )
    out.append(
        bench(
            "hf_cb",
            "hf-cb",
            4 if cpu else 128,
            8 if cpu else 256,
            45,
            cpu_skip="hf's command with --systems hf-cb, a system tests/e2e/test_bench_profile.py runs",
        )
    )
    out.append(
        bench(
            "static",
            "static",
            4 if cpu else 128,
            8 if cpu else 256,
            45,
            cpu_skip="bin/bench's command with --systems static, a system tests/e2e/test_bench_profile.py runs",
        )
    )
    # Window 2: compiled HF, the batch-1 baseline (faster per token than compiled HF at batch 1).
    out.append(bench("hf_compiled_b1", "hf-compiled", 1, 2 if cpu else 4, 240, window=2))
    out.append(
        bench(
            "hf_compiled_b8",
            "hf-compiled",
            2 if cpu else 8,
            4 if cpu else 16,
            240,
            window=2,
            cpu_skip="hf_compiled_b1's command at batch 8",
        )
    )
    return out


def has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None
