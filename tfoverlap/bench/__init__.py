"""Benchmarks on the emulated testbed: worker processes, the driver, metrics and reports."""
