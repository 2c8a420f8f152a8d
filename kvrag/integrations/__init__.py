"""Framework adapters over kvrag's public API: `kvrag.integrations.langchain` and
`kvrag.integrations.llama_index` (installed with the ``langchain`` / ``llamaindex`` extras).
"""
