"""The testbed: local clusters, models and measurements for tests and benchmarks."""
