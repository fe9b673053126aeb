"""bin/bench's parts: seeded workloads, the systems under test, metrics, reports and plots."""
