"""Seeded request sets: prompt token ids and exact output lengths (every system runs with
EOS ignored, so each request produces exactly its ``output_len`` tokens everywhere).

Workloads (lengths in tokens; docs/benchmarks.md repeats this with the sources):
- ``fixed``: every prompt ``prompt_len`` long, every output ``output_len``.
- ``uniform``: prompt and output lengths each uniform on ``[min_len, max_len]``; the default
  100..1024 is nano-vllm's benchmark.
- ``sharegpt``: lognormal lengths whose means are the ShareGPT figures of the vLLM paper
  (Kwon et al., SOSP 2023, Fig. 11a: 161.31 input and 337.99 output tokens on average).
  The paper gives no spread; sigma = 1.0 for both is our assumption. Lengths are clipped to
  [4, 1024] like the paper's chatbot experiment, which capped both at 1024, and mu is
  solved so that the mean *after* clipping is the published one. ``scale`` (default 1)
  multiplies both means and the upper clip: the same shape, shorter, for small machines.
- ``high-variance``: prompts uniform on [16, 256]; outputs short (uniform [8, 32]) with
  probability 0.8 and very long (uniform [512, 1024]) otherwise: the mix where a static
  batch idles on its one long member.
- ``lognormal``: every prompt ``prompt_len`` long; outputs lognormal with mean
  ``output_len`` (after clipping to [1, 16 x output_len], rounded) and log-space spread
  ``output_sigma``: the same mean at any spread, for the output-length variance sweep
  (sigma 0 gives every request exactly ``output_len``).

Every length pair is finally clamped so that prompt + output fits ``max_model_len``; how many
were clamped is recorded, so a clamped run is never mistaken for the nominal workload.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WORKLOADS = ("fixed", "uniform", "sharegpt", "high-variance", "lognormal")

SHAREGPT_MEAN_PROMPT = 161.31  # vLLM paper, Fig. 11a
SHAREGPT_MEAN_OUTPUT = 337.99  # vLLM paper, Fig. 11a
SHAREGPT_SIGMA = 1.0  # assumption: the paper publishes means only
SHAREGPT_CLIP = (4, 1024)
HV_PROMPT = (16, 256)
HV_SHORT = (8, 32)
HV_LONG = (512, 1024)
HV_LONG_FRACTION = 0.2
LOGNORMAL_CLIP_FACTOR = 16  # lognormal workload: outputs clipped to [1, 16 x the mean]


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    sampling: dict[str, Any] = field(default_factory=dict)  # extra generate fields (sampling controls)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Workload:
    name: str
    seed: int
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)
    num_clamped: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict[str, Any]:
        prompts = np.array([r.prompt_len for r in self.requests])
        outputs = np.array([r.output_len for r in self.requests])
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "params": self.params,
            "num_clamped": self.num_clamped,
            "prompt_tokens": int(prompts.sum()),
            "output_tokens": int(outputs.sum()),
            "prompt_len": _stats(prompts),
            "output_len": _stats(outputs),
        }


# What a request of a --controls-fraction run asks for: every sampling control that costs a
# pass over its logits row (the penalties, a few biases; min_tokens ends within its first
# tokens, so it is left out). Token ids 10 and 20 exist in every vocabulary benchmarked.
SAMPLING_CONTROLS: dict[str, Any] = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {10: 1.0, 20: -1.0},
}


def with_controls(workload: Workload, fraction: float) -> Workload:
    """``workload`` with :data:`SAMPLING_CONTROLS` on ``fraction`` of its requests, spread
    evenly (:func:`with_fields`)."""
    return with_fields(workload, fraction, SAMPLING_CONTROLS, "controls_fraction")


def with_logprobs(workload: Workload, fraction: float, k: int) -> Workload:
    """``workload`` with ``logprobs=k`` on ``fraction`` of its requests (:func:`with_fields`)."""
    workload = with_fields(workload, fraction, {"logprobs": k}, "logprobs_fraction")
    workload.params["logprobs"] = k
    return workload


def with_fields(workload: Workload, fraction: float, fields: dict[str, Any], param: str) -> Workload:
    """``workload`` with the generate ``fields`` added to ``fraction`` of its requests, spread
    evenly (request ``i`` when ``floor((i + 1) * fraction)`` steps up), so a batch of any
    size holds about that fraction; ``param`` records the fraction in the workload's params."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"{param.replace('_', ' ')} must be in [0, 1], got {fraction}")
    requests = [
        BenchRequest(r.prompt_ids, r.output_len, {**r.sampling, **fields})
        if math.floor((i + 1) * fraction) > math.floor(i * fraction)
        else r
        for i, r in enumerate(workload.requests)
    ]
    params = {**workload.params, param: fraction}
    return Workload(workload.name, workload.seed, requests, params, workload.num_clamped)


def _stats(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(x.mean()), "p50": float(np.median(x)), "min": int(x.min()), "max": int(x.max())}


def _clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[min(max(X, lo), hi)] for X ~ lognormal(mu, sigma)."""

    def cdf(z: float) -> float:
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    inside = math.exp(mu + sigma * sigma / 2) * (cdf(b - sigma) - cdf(a - sigma))
    return lo * cdf(a) + hi * (1.0 - cdf(b)) + inside


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, clip: tuple[int, int]) -> np.ndarray:
    """Lognormal lengths whose mean after clipping to ``clip`` is ``mean``; rounded."""
    lo_mu, hi_mu = math.log(clip[0]), math.log(clip[1])
    for _ in range(100):  # bisection: the clipped mean increases with mu
        mu = (lo_mu + hi_mu) / 2
        if _clipped_lognormal_mean(mu, sigma, *clip) < mean:
            lo_mu = mu
        else:
            hi_mu = mu
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), *clip).astype(np.int64)


def lowest_token(vocab_size: int) -> int:
    """Token ids are drawn well inside the vocabulary, away from the low ids tokenizers give special tokens."""
    return 10 if vocab_size > 64 else 1


def make_workload(
    name: str,
    num_requests: int,
    *,
    seed: int = 0,
    vocab_size: int,
    max_model_len: int,
    prompt_len: int = 128,
    output_len: int = 128,
    min_len: int = 100,
    max_len: int = 1024,
    scale: float = 1.0,
    output_sigma: float = 1.0,
) -> Workload:
    """The ``name`` workload's ``num_requests`` requests, the same for a given seed everywhere."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError("num_requests must be positive")
    if scale <= 0 or output_sigma < 0:
        raise ValueError("scale must be positive and output_sigma non-negative")
    rng = np.random.default_rng(seed)
    n = num_requests
    if name == "fixed":
        prompts = np.full(n, prompt_len)
        outputs = np.full(n, output_len)
        params: dict[str, Any] = {"prompt_len": prompt_len, "output_len": output_len}
    elif name == "uniform":
        prompts = rng.integers(min_len, max_len + 1, n)
        outputs = rng.integers(min_len, max_len + 1, n)
        params = {"min_len": min_len, "max_len": max_len}
    elif name == "sharegpt":
        clip = (SHAREGPT_CLIP[0], max(SHAREGPT_CLIP[0] + 1, round(SHAREGPT_CLIP[1] * scale)))
        prompts = _lognormal(rng, SHAREGPT_MEAN_PROMPT * scale, SHAREGPT_SIGMA, n, clip)
        outputs = _lognormal(rng, SHAREGPT_MEAN_OUTPUT * scale, SHAREGPT_SIGMA, n, clip)
        params = {
            "mean_prompt": SHAREGPT_MEAN_PROMPT * scale,
            "mean_output": SHAREGPT_MEAN_OUTPUT * scale,
            "sigma": SHAREGPT_SIGMA,
            "clip": list(clip),
            "scale": scale,
            "source": "vLLM paper (Kwon et al., SOSP 2023) Fig. 11a means; sigma assumed",
        }
    elif name == "lognormal":
        prompts = np.full(n, prompt_len)
        if output_sigma == 0:
            outputs = np.full(n, output_len)
        else:
            clip = (1, max(2, LOGNORMAL_CLIP_FACTOR * output_len))
            outputs = _lognormal(rng, output_len, output_sigma, n, clip)
        params = {"prompt_len": prompt_len, "mean_output": output_len, "output_sigma": output_sigma}
    else:
        prompts = rng.integers(HV_PROMPT[0], HV_PROMPT[1] + 1, n)
        long = rng.random(n) < HV_LONG_FRACTION
        outputs = np.where(
            long,
            rng.integers(HV_LONG[0], HV_LONG[1] + 1, n),
            rng.integers(HV_SHORT[0], HV_SHORT[1] + 1, n),
        )
        params = {
            "prompt": list(HV_PROMPT),
            "short_output": list(HV_SHORT),
            "long_output": list(HV_LONG),
            "long_fraction": HV_LONG_FRACTION,
        }
    low = lowest_token(vocab_size)
    requests, clamped = [], 0
    for p, o in zip(prompts.tolist(), outputs.tolist()):
        p = max(1, min(int(p), max_model_len - 1))
        o = max(1, int(o))
        if p + o > max_model_len:
            o = max_model_len - p
            clamped += 1
        ids = rng.integers(low, vocab_size, p).tolist()
        requests.append(BenchRequest(ids, o))
    return Workload(name, seed, requests, params, clamped)


def retokenized(workload: Workload, seed: int, vocab_size: int, *, max_output_len: int | None = None) -> Workload:
    """``workload``'s requests with the same prompt lengths and sampling but fresh random token
    ids (``max_output_len``: outputs capped): a warm-up that compiles the shapes a run will
    meet, or a second timed run, without hitting the prefix cache of the first."""
    rng = np.random.default_rng(seed)
    low = lowest_token(vocab_size)
    requests = [
        BenchRequest(
            rng.integers(low, vocab_size, r.prompt_len).tolist(),
            r.output_len if max_output_len is None else min(r.output_len, max_output_len),
            r.sampling,
        )
        for r in workload.requests
    ]
    return Workload(workload.name, seed, requests, workload.params, workload.num_clamped)


#: make_workload's length parameters: bin/bench's and bin/sim's flags of the same names set them.
LENGTH_PARAMS = ("prompt_len", "output_len", "min_len", "max_len", "scale", "output_sigma")


def workload_from_args(args: argparse.Namespace, *, vocab_size: int, max_model_len: int) -> Workload:
    """The workload a command line names (``--workload``, ``--num-requests``, ``--seed`` and the
    length flags): bin/sim replays bin/bench's requests, so both build them here."""
    lengths = {name: getattr(args, name) for name in LENGTH_PARAMS}
    return make_workload(
        args.workload, args.num_requests, seed=args.seed, vocab_size=vocab_size, max_model_len=max_model_len, **lengths
    )


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of a Poisson process at ``rate`` requests/s (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError("rate must be positive")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def bench_schema(output_len: int) -> dict[str, Any]:
    """A JSON schema no answer of ``output_len`` tokens can complete (an array of at least that
    many objects, each several tokens), so a constrained request runs its full length like an
    unconstrained one with ``ignore_eos`` and the two cost the same tokens; the objects have
    the usual mix (integers, bounded strings, enums, booleans)."""
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["a", "b", "c"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "ok"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": item, "minItems": output_len}


def constrain_fraction(workload: Workload, fraction: float) -> Workload:
    """``workload`` with ``fraction`` of its requests under :func:`bench_schema`, spread as
    :func:`with_controls` spreads its share."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"constrained fraction must be in [0, 1], got {fraction}")
    requests = [
        BenchRequest(
            r.prompt_ids,
            r.output_len,
            {**r.sampling, "constraint": {"type": "json_schema", "schema": bench_schema(r.output_len)}},
        )
        if math.floor((i + 1) * fraction) > math.floor(i * fraction)
        else r
        for i, r in enumerate(workload.requests)
    ]
    params = {**workload.params, "constrained_fraction": fraction}
    return Workload(workload.name, workload.seed, requests, params, workload.num_clamped)
