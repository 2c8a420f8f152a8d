"""Optional accelerated kernels (Triton/CUDA). kvrag runs without them: every kernel has a
pure-PyTorch reference in the core, chosen behind one function, and a test comparing the two.
None ship yet."""
