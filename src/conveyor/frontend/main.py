"""Entry point of the frontend process (started by bin/serve)."""

from __future__ import annotations

import zmq

from conveyor.runtime.process import ControlChannel, die_with_parent, setup_logging
from conveyor.frontend.server import Frontend, FrontendConfig
from conveyor.frontend.tokenizer import Tokenizer


def run_frontend(config: FrontendConfig) -> None:
    die_with_parent()
    log = setup_logging("frontend")
    control = ControlChannel(zmq.Context.instance(), config.addresses.control, "frontend")
    try:
        import uvloop

        tokenizer = Tokenizer.from_dir(config.model_dir)
        frontend = Frontend(config, tokenizer)
    except Exception as exc:
        log.exception("frontend failed to start")
        control.failed(f"frontend: {exc}")
        return
    control.ready(address=config.addresses.client)
    try:
        uvloop.run(frontend.run())
    finally:
        frontend.close()
        control.close()
