"""The index-time stages: read documents, split them (KVSplit), embed the chunks, compute their caches.

`kvrag.indexing.build.Builder` drives them and hands each chunk to `kvrag.storage`; nothing here runs at
question time except `kvgen` and `recompute` (a missing or damaged chunk is recomputed from its text).
"""
