"""Per-request LoRA adapters: many fine-tunes of one base model served in one batch.

An adapter's directory is read once, at its load, into a float32 host copy (an LRU, spilled to
the worker's own file past ``max_cpu_loras``); ``max_loras`` device slots fill a
:class:`LoraStack` per targeted projection, fused projections keeping one shrink and one
expand; a step adds every token's delta batched (:mod:`conveyor.worker.lora_delta`).
docs/architecture.md, "LoRA adapters", says why and how.
"""

from __future__ import annotations

import itertools
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conveyor.checkpoints.model_config import ModelConfig

# The errors are lora_config's (torch-free, for bin/serve's checks); imported from here too.
from conveyor.worker.lora_config import WEIGHTS_FILE, LoraFilesMissing, LoraLoadError, read_adapter_config  # noqa: F401
from conveyor.worker.lora_delta import LoraContext, LoraStack
from conveyor.worker.models.interface import CausalLM, LoraTarget
from conveyor.worker.models.registry import model_class

_PEFT_PREFIX = "base_model.model."


class UnknownAdapter(KeyError):
    """A request named an adapter nobody registered."""


@dataclass(frozen=True)
class LoraOptions:
    """``max_loras`` device slots, ranks up to ``max_lora_rank``, ``max_cpu_loras`` host copies
    (at least ``max_loras``; None: as many as slots). The defaults are RunnerConfig's."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras}")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass
class LoraAdapter:
    """An adapter's host copy: checkpoint module name (``model.layers.3.self_attn.q_proj``)
    -> ``(A [r, in], scaling * B [out, r])``, float32 on the CPU."""

    name: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _expected_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """``(in, out)`` features of ``target`` (one of
    :data:`~conveyor.worker.models.interface.DECODER_LORA_TARGETS`) in the unsplit base model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, m = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, m),
        "up_proj": (h, m),
        "down_proj": (m, h),
    }[target]


def read_adapter(name: str, directory: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA directory (``adapter_config.json``,
    ``adapter_model.safetensors``) against the base model ``config``.

    Raises :class:`LoraLoadError` for a missing file, a non-LoRA or unsupported adapter
    (DoRA, trained biases, extra saved modules), a rank over ``max_rank``, a target module the
    model lacks, or a tensor whose shape or layer does not fit the base model (an adapter of
    another base). Scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), folded into B.
    """
    checked = read_adapter_config(name, directory, max_rank)
    rank, scaling, targets = checked.rank, checked.scaling, checked.targets
    weights_path = Path(directory) / WEIGHTS_FILE
    supported: Mapping[str, LoraTarget] = model_class(config.architecture).lora_targets
    lacking = sorted(set(targets) - set(supported))
    if lacking and config.moe is not None and set(lacking) <= {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}:
        raise LoraLoadError(
            f"adapter {name!r}: LoRA on a mixture-of-experts model's experts ({', '.join(lacking)}) is not "
            f"supported; target the attention projections ({', '.join(supported)})"
        )
    if lacking:
        raise LoraLoadError(
            f"adapter {name!r}: target module(s) {', '.join(lacking)} the model lacks "
            f"(supported: {', '.join(supported)})"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as reader:
        for key in reader.keys():
            module, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            parts = module.split(".")
            if kind not in ("A.weight", "B.weight") or len(parts) != 5 or parts[:2] != ["model", "layers"]:
                raise LoraLoadError(f"adapter {name!r}: unexpected tensor {key!r}")
            layer, sub, target = parts[2], parts[3], parts[4]
            if target not in supported or supported[target].module != sub:
                raise LoraLoadError(f"adapter {name!r}: tensor {key!r} targets a module the model lacks")
            if not layer.isdigit() or int(layer) >= config.num_layers:
                raise LoraLoadError(
                    f"adapter {name!r}: tensor {key!r} names layer {layer} of a {config.num_layers}-layer "
                    "model (an adapter of another base model?)"
                )
            pairs.setdefault(module, {})[kind[0]] = reader.get_tensor(key).to(torch.float32)
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"adapter {name!r}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        in_features, out_features = _expected_shape(config, module.rsplit(".", 1)[1])
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoraLoadError(
                f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the base model "
                f"needs ({rank}, {in_features}) and ({out_features}, {rank}) (an adapter of another base model?)"
            )
        weights[module] = (a, b * scaling)
    if not weights:
        raise LoraLoadError(f"adapter {name!r}: {weights_path} holds no LoRA weights")
    return LoraAdapter(name, rank, weights)


class SpilledAdapters:
    """Host copies evicted from the LRU, each in a safetensors file of a private temporary
    directory (made on the first spill, removed with this object or at exit): the float32
    ``A`` and scaled ``B`` exactly as held, so a copy read back is the one spilled."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory | None = None
        self._files: dict[str, Path] = {}
        self._numbers = itertools.count()  # file names (adapter names may hold any character)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def write(self, adapter: LoraAdapter) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="conveyor-lora-")
        path = Path(self._dir.name) / f"{next(self._numbers)}.safetensors"
        tensors = {f"{module}.{kind}": t for module, pair in adapter.weights.items() for kind, t in zip("AB", pair)}
        save_file(tensors, str(path), metadata={"rank": str(adapter.rank)})
        self._files[adapter.name] = path

    def read(self, name: str) -> LoraAdapter:
        with safe_open(str(self._files[name]), framework="pt", device="cpu") as reader:
            rank = int(reader.metadata()["rank"])
            tensors = {key: reader.get_tensor(key) for key in reader.keys()}
        modules = {key.rsplit(".", 1)[0] for key in tensors}
        return LoraAdapter(name, rank, {m: (tensors[f"{m}.A"], tensors[f"{m}.B"]) for m in modules})

    def forget(self, name: str) -> None:
        path = self._files.pop(name, None)
        if path is not None:
            path.unlink(missing_ok=True)


class LoraManager:
    """Registered adapters, their host copies and device slots, for one model (one rank).

    Attaches a :class:`LoraStack` to every projection adapters may target. Adapter ids are
    positive ints, never reused (0: the base model)."""

    def __init__(self, model: CausalLM, options: LoraOptions) -> None:
        self.model = model
        self.options = options
        self.config: ModelConfig = model.config
        self.targets = model.lora_targets
        self.dtype, self.device = model.dtype, model.device
        self.context = LoraContext(self.device, self.dtype)
        self._layout = model.checkpoint_layout()
        self._stacks: dict[str, LoraStack] = {}
        for layer in range(self.config.num_layers):
            columns: dict[str, list[tuple[int, int]]] = {}  # fused module -> its pieces' output columns
            for target, where in self.targets.items():
                slot = self._layout[f"model.layers.{layer}.{where.module}.{target}.weight"]
                columns.setdefault(slot.name.removesuffix(".weight"), []).append((slot.start, slot.end))
            for module_name, pieces in columns.items():
                linear = model.get_submodule(module_name)
                out_features, in_features = linear.out_features, linear.in_features
                linear.lora = LoraStack(
                    options.max_loras, options.max_lora_rank, pieces, in_features, out_features, self.context
                )
                self._stacks[module_name] = linear.lora
        self._ids: dict[str, int] = {}
        self._next_id = 1
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, newest last
        self._spilled = SpilledAdapters()  # those evicted from it
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU newest last
        self._free_slots = list(range(options.max_loras - 1, -1, -1))

    @property
    def names(self) -> list[str]:
        return list(self._ids)

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model (None or empty), else the registered adapter's id."""
        if not name:
            return 0
        if name not in self._ids:
            raise UnknownAdapter(name)
        return self._ids[name]

    def read(self, name: str, directory: str | Path) -> LoraAdapter:
        """Read and check the adapter (:func:`read_adapter`) against this model; changes
        nothing here, so it may run on another thread than the steps."""
        return read_adapter(name, directory, self.config, self.options.max_lora_rank)

    def register(self, name: str, directory: str | Path, adapter: LoraAdapter | None = None) -> int:
        """Register the adapter under ``name``: ``adapter`` as :meth:`read` gave it, or (None)
        read now; raises :class:`LoraLoadError` leaving everything as it was."""
        if name in self._ids:
            raise LoraLoadError(f"adapter {name!r} is already loaded")
        if adapter is None:
            adapter = self.read(name, directory)
        self._ids[name] = self._next_id
        self._next_id += 1
        self._cache(adapter)
        return self._ids[name]

    def unregister(self, name: str) -> None:
        """Forget ``name`` (its slot is freed; running requests must not use it any more)."""
        adapter_id = self._ids.pop(name)  # KeyError: unknown
        self._host.pop(name, None)
        self._spilled.forget(name)
        slot = self._resident.pop(adapter_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _cache(self, adapter: LoraAdapter) -> None:
        """Hold ``adapter``'s host copy (newest in the LRU); the least recent over
        ``max_cpu_loras`` go to the spill files (written once: a copy never changes)."""
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.options.host_capacity:
            _, evicted = self._host.popitem(last=False)
            if evicted.name not in self._spilled:
                self._spilled.write(evicted)

    def _host_copy(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # evicted from the host LRU: back from its spill file, never the user's directory
            adapter = self._spilled.read(name)
        self._cache(adapter)
        return adapter

    def slots_for(self, adapter_ids: set[int]) -> dict[int, int]:
        """Make every adapter of ``adapter_ids`` (positive) resident, evicting LRU slots the set
        does not use; returns id -> slot. ValueError if they are more than the slots."""
        if len(adapter_ids) > self.options.max_loras:
            raise ValueError(f"{len(adapter_ids)} adapters in one step, --max-loras is {self.options.max_loras}")
        names = {adapter_id: name for name, adapter_id in self._ids.items()}
        for adapter_id in adapter_ids:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
                continue
            if not self._free_slots:
                victim = next(i for i in self._resident if i not in adapter_ids)
                self._free_slots.append(self._resident.pop(victim))
            slot = self._free_slots.pop()
            self._fill(slot, self._host_copy(names[adapter_id]))
            self._resident[adapter_id] = slot
        return {adapter_id: self._resident[adapter_id] for adapter_id in adapter_ids}

    @torch.no_grad()
    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into row ``slot`` of every stack: its targets' pieces, this rank's
        shard of each (rows of B, columns of A, as the base layout names), zeros elsewhere."""
        for stack in self._stacks.values():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
        r, rank = self.options.max_lora_rank, adapter.rank
        for module, (a, b) in adapter.weights.items():
            target = module.rsplit(".", 1)[1]
            piece = self.targets[target].piece
            place = self._layout[f"{module}.weight"]
            stack = self._stacks[place.name.removesuffix(".weight")]
            if place.cols is not None:
                a = a[:, place.cols[0] : place.cols[1]]
            if place.rows is not None:
                b = b[place.rows[0] : place.rows[1]]
            stack.a[slot, piece * r : piece * r + rank].copy_(a)
            stack.b[slot, place.start : place.end, piece * r : piece * r + rank].copy_(b)

    def begin_step(self, row_adapters: np.ndarray, row_tokens: np.ndarray) -> bool:
        """Set the step's batch from each row's adapter id and token count (rows laid end to
        end, as the forward's tokens are); returns whether any row uses an adapter."""
        if not row_adapters.any():
            self.context.batch = None
            return False
        ids = set(np.unique(row_adapters[row_adapters > 0]).tolist())
        slot_of = self.slots_for(ids)
        lookup = np.full(int(row_adapters.max()) + 1, -1, dtype=np.int64)
        for adapter_id, slot in slot_of.items():
            lookup[adapter_id] = slot
        token_slots = np.repeat(lookup[row_adapters], row_tokens)
        self.context.begin(token_slots)
        return True

    def end_step(self) -> None:
        self.context.batch = None
