"""Generation: decode tokens from a fused cache, with streaming text and stop strings."""
