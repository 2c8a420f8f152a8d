"""Where an index lives: the FAISS + SQLite chunk index, chunk-cache stores, the container format,
checksums and atomic writes.

Stores are registered by name (`kvrag.storage.stores`); `KVStore` puts chunk caches through a codec and the
container. Nothing here knows about models or fusion.
"""
