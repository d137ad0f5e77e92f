"""Test and single-process tools: an in-process coordinator and fake inference engines
(real HTTP servers that write real trace files), used by tests, benchmarks and the demo.
"""
