"""Where an index lives: the FAISS + SQLite chunk index, chunk-cache stores, the container format,
checksums and atomic writes.

Byte stores are registered by name (`kvrag.storage.stores`: ``file``/``disk``, ``memory``, ``throttled``);
`kvrag.storage.kvstore.KVStore` puts chunk caches through a codec and the container into one.
Nothing here knows about models or fusion.
"""
