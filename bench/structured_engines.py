"""Compare the grammar engines for structured output: xgrammar vs llguidance.

    PYTHONPATH=src python3 bench/structured_engines.py [--tokenizer PATH/tokenizer.json ...]

For each tokenizer (default: the demo checkpoint's) and each constraint kind, it measures
compile time (the compile call plus the first mask, since llguidance builds its lexer lazily:
that sum is what a request waits for before its first constrained step) with the engines'
own caches off, then per-token mask fill while a valid answer is fed back one token at a time,
at batch 1 (one matcher) and batch 32 (32 matchers filling the rows of one bitmask one after
another on one thread: the CPU work per step, which a thread pool divides by its cores). Both
engines write the same bitmask layout (int32 words, bit i of word j = token 32j+i allowed). Figures
are written up in docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR

SCHEMA_SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
SCHEMA_NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "owner": {
            "type": "object",
            "properties": {"first": {"type": "string"}, "last": {"type": "string"}, "email": {"type": "string"}},
            "required": ["first", "last"],
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["id", "tags", "kind", "owner"],
}
# (name, kind, spec, a valid answer fed back token by token)
CASES = [
    ("schema small", "json_schema", SCHEMA_SMALL, '{"name": "Ada Lovelace", "age": 36, "ok": true}'),
    (
        "schema nested",
        "json_schema",
        SCHEMA_NESTED,
        '{"id": 7, "tags": ["x", "serving"], "kind": "beta", "owner": {"first": "Grace", "last": "Hopper"},'
        ' "scores": [1.5, 2]}',
    ),
    ("json_object", "json_object", None, '{"a": [1, 2, {"b": null}], "c": "text with words"}'),
    ("regex", "regex", r"\d{3}-[a-z]{2,8}-(red|green|blue)", "123-abcdef-green"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
    (
        "ebnf",
        "grammar",
        'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+',
        "(12+3)+45+(6+(7+8))",
    ),
]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, eos: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
        self.tokenizer_s = time.perf_counter() - t
        self.vocab = self.info.vocab_size

    def compile(self, kind, spec):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token):
        assert m.accept_token(token), token


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, eos: int) -> None:
        import llguidance
        import llguidance.numpy as llnp

        self.llg, self.llnp = llguidance, llnp
        t = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(encoding="utf-8"), eos_token=eos)
        self.tokenizer_s = time.perf_counter() - t
        self.vocab = self.tok.vocab_size

    def compile(self, kind, spec):
        g = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = g.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = g.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = g.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = g.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
        else:
            grammar = self.llg.grammar_from("ebnf", spec)
        # The compiled form is a prototype matcher (as conveyor.structured keeps it): each
        # request's matcher is a deep copy, sharing the lexer states its prototype has built.
        proto = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not proto.is_error(), proto.get_error()
        return proto

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, row):
        self.llnp.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m, token):
        assert m.consume_token(token), (token, m.get_error())


def measure(engine, tokens: list[int], case, repeats: int) -> dict:
    _, kind, spec, _ = case
    width = (engine.vocab + 31) // 32
    compile_s = []
    for _ in range(repeats):
        bitmask = np.full((1, width), -1, dtype=np.int32)
        t = time.perf_counter()
        m = engine.matcher(engine.compile(kind, spec))
        engine.fill(m, bitmask, 0)
        compile_s.append(time.perf_counter() - t)
    compiled = engine.compile(kind, spec)
    # batch 1: fill, check the answer's token is allowed, accept it
    m = engine.matcher(compiled)
    bitmask = np.full((1, width), -1, dtype=np.int32)
    fill1 = []
    for tok in tokens:
        t = time.perf_counter()
        engine.fill(m, bitmask, 0)
        fill1.append(time.perf_counter() - t)
        assert (bitmask[0, tok // 32] >> (tok % 32)) & 1, f"{engine.name}: answer token {tok} masked out"
        engine.accept(m, tok)
    # batch 32: 32 matchers walk the same answer; 32 row fills per step
    ms = [engine.matcher(compiled) for _ in range(32)]
    bitmask = np.full((32, width), -1, dtype=np.int32)
    fill32 = []
    for tok in tokens:
        t = time.perf_counter()
        for row, x in enumerate(ms):
            engine.fill(x, bitmask, row)
        fill32.append(time.perf_counter() - t)
        for x in ms:
            engine.accept(x, tok)
    return {
        "compile_ms": statistics.median(compile_s) * 1000,
        "fill1_us": statistics.median(fill1) * 1e6,
        "fill32_us": statistics.median(fill32) * 1e6,
        "fill32_max_us": max(fill32) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, action="append", help="tokenizer.json (repeatable); default: demo")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer

    for path in args.tokenizer or [TOKENIZER_DIR / "tokenizer.json"]:
        backend = Tokenizer.from_file(str(path))
        eos = backend.token_to_id("<|eot_id|>")
        print(f"\n## {path} (vocab {backend.get_vocab_size()})\n")
        engines = [XGrammarEngine(path, eos), LLGuidanceEngine(path, eos)]
        for e in engines:
            print(f"{e.name}: tokenizer setup {_ms(e.tokenizer_s)} ms")
        print(
            "\n| constraint | engine | compile + first mask (ms) | fill, batch 1 (us/token) | fill, batch 32 "
            "(us/step) | batch 32 worst step (us) |"
        )
        print("|---|---|---|---|---|---|")
        for case in CASES:
            tokens = backend.encode(case[3], add_special_tokens=False).ids
            for e in engines:
                r = measure(e, tokens, case, args.repeats)
                print(
                    f"| {case[0]} | {e.name} | {r['compile_ms']:.2f} | {r['fill1_us']:.0f} | {r['fill32_us']:.0f} |"
                    f" {r['fill32_max_us']:.0f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
