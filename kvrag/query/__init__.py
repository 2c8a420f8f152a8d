"""The question-time pipeline: retrieve -> plan -> load -> fuse -> generate, each stage handing the next a value.

`kvrag.query.flat` does the same for a flat prompt string handed over by a framework.
"""
