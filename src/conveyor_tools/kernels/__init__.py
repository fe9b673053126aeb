"""Helpers for the Triton kernels of :mod:`conveyor.kernels`, used by the tests and the benchmarks only.

- :mod:`.testing`: paged test inputs and tolerances shared by tests and the benchmark.
- :mod:`.compile_check`: compile every kernel for sm_90 without a GPU.
"""
