"""Schedulers: plain-data algorithms that decide orders (no TensorFlow here)."""
