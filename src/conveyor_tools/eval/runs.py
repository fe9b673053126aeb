"""The task set's replies: from a Conveyor server (every item sent at once over the ZeroMQ
client, greedy) and from transformers on the same checkpoint (greedy ``generate``, one item
at a time, unpadded: the reference), and the accuracy of each."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from conveyor_tools.eval.tasks import Item


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int]


def served_replies(address: str, items: list[Item], max_tokens: int) -> list[Reply]:
    """Every item's greedy reply from the server at ``address``, all requests in flight at once."""
    from conveyor.client import AsyncClient

    async def run() -> list[Reply]:
        client = AsyncClient(address)
        try:
            results = await asyncio.gather(
                *(client.generate(messages=item.messages(), max_tokens=max_tokens, temperature=0.0) for item in items)
            )
        finally:
            await client.close()
        return [Reply(r.text, list(r.token_ids)) for r in results]

    return asyncio.run(run())


def hf_replies(model_dir: str, items: list[Item], max_tokens: int, threads: int | None = None) -> list[Reply]:
    """Every item's greedy reply from transformers on ``model_dir`` (a GGUF checkpoint's
    directory loads the GGUF file itself), float32 on the CPU; the chat rendered by its
    ``apply_chat_template``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor_tools.bench.hf import pretrained_source, quiet_transformers

    quiet_transformers()
    if threads:
        torch.set_num_threads(threads)
    source, gguf = pretrained_source(model_dir)
    model = AutoModelForCausalLM.from_pretrained(source, **gguf, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    replies = []
    for item in items:
        prompt = tokenizer.apply_chat_template(item.messages(), add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        replies.append(Reply(tokenizer.decode(tokens, skip_special_tokens=True), tokens))
    return replies


def accuracy(items: list[Item], correct: list[bool]) -> dict[str, Any]:
    """Right answers by category and in all: ``{category: [right, total], ..., "all": [right, total]}``."""
    right, total = Counter(), Counter()
    for item, ok in zip(items, correct):
        total[item.category] += 1
        right[item.category] += ok
    table = {category: [right[category], total[category]] for category in total}
    table["all"] = [sum(right.values()), len(items)]
    return table
