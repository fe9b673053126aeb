"""conveyor-sim: a deployment simulator driven by the real scheduler (docs/architecture.md, tools)."""
