"""Entry point of the frontend process (started by bin/serve)."""

from __future__ import annotations

from conveyor.frontend.server import Frontend
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.runtime.config import FrontendConfig
from conveyor.runtime.process import Started, run_process


def run_frontend(config: FrontendConfig) -> None:
    # The frontend's sockets live in an asyncio context of its own: the harness's context
    # serves only the control line.
    run_process("frontend", config.addresses.control, lambda ctx: _start(config))


def _start(config: FrontendConfig) -> Started:
    import uvloop

    frontend = Frontend(config, Tokenizer.from_dir(config.model_dir))
    return Started(
        run=lambda: uvloop.run(frontend.run()), close=frontend.close, ready_info={"address": config.addresses.client}
    )
