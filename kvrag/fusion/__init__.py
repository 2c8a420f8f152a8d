"""Fusion: turn the prompt's stored chunk caches into one cache with a selective recompute.

Selectors choose which positions are recomputed; each is one class registered under a mode name
(`kvrag.fusion.selectors`). `fuse` runs the model's own decoder layers on the selected positions only.
"""
