"""Optional accelerated kernels (Triton/CUDA). kvrag runs without them: every kernel has a reference
in the core, chosen behind one function, and a test comparing the two.

- `rans_decode`: the rANS decoder of the ``cachegen`` codec for many streams at once (reference:
  `kvrag.codec.rans.decode`; chosen by `kvrag.codec.cachegen.CacheGenCodec.decode_region`).
"""
