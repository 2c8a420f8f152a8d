"""The index-time stages: read documents, split them (KVSplit), embed the chunks, compute their caches.

`kvrag.indexing.build.Builder` drives them and hands each chunk to `kvrag.storage`; nothing here runs at
question time except `kvgen` (a missing chunk is recomputed from its text) and `neighbours`.
"""
