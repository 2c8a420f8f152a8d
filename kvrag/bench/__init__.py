"""Benchmarks: ``kvrag bench NAME`` runs the module ``kvrag.bench.<name>`` (``run(args) -> int``) with the options
`kvrag.bench.options` gives it. Every speed figure is a ratio against ``full`` measured in the same run.
"""
