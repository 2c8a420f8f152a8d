"""Benchmarks: each submodule exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is
mounted as ``kvrag bench NAME``. Every speed figure is a ratio against ``full`` measured in the same
run.
"""

BENCHES = ("quality", "speed", "codec", "decode", "build")
