"""The frontend process and the demo checkpoint writer work where torch cannot be imported."""

from __future__ import annotations

import os

from tests.no_torch import run_without_torch

SCRIPT = """
from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer
import conveyor.frontend.main  # the whole frontend process, server included

tok = Tokenizer.from_dir(demo_checkpoint_dir())
prompt = tok.apply_chat_template([{"role": "user", "content": "Bonjour ☃ 你好"}])
assert prompt[0] == tok.bos_token_id
output = tok.encode("Salut 😀, ça va?", add_special_tokens=False)
detok = IncrementalDetokenizer(tok, prompt)
stop = StopStringMatcher(["?"])
shown = "".join(stop.feed(detok.push([t]))[0] for t in output)
assert shown == "Salut 😀, ça va", shown
assert tok.decode(output) == "Salut 😀, ça va?"
"""


def test_frontend_modules_never_need_torch(tmp_path) -> None:
    run_without_torch(SCRIPT, env={**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache")})
