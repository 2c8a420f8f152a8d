"""Passage caches without an index: any retriever's passages, their KV computed on first sight and reused after.

`PassageCache` answers the flat prompts LangChain and LlamaIndex hand an LLM, finding the passages in them
(`kvrag.passages.finder`), over a store bounded in bytes that a URL names (`kvrag.passages.cache_url`).
"""

from kvrag.passages.cache import CacheStats, PassageCache
from kvrag.passages.cache_url import DEFAULT_MAX_BYTES, open_cache_store, parse_bytes
from kvrag.passages.finder import find_passages
from kvrag.user_cache import default_cache_dir

__all__ = ["DEFAULT_MAX_BYTES", "CacheStats", "PassageCache", "default_cache_dir", "find_passages",
           "open_cache_store", "parse_bytes"]
