"""Conveyor's tools, kept out of the serving package ``conveyor``: bin/bench's harness
(``conveyor_tools.bench``, ``conveyor_tools.cli.bench``), bin/soak (``conveyor_tools.cli.soak``),
and the kernels' test helpers (``conveyor_tools.kernels``). They import ``conveyor``; nothing in
``conveyor`` imports them. Installed by the same pyproject; their extra dependencies
(transformers for the HF baselines, matplotlib for plots) are the ``bench`` and ``test`` extras.
"""
