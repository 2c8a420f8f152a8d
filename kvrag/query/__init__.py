"""Question time, one path for every answer: a first stage lays the prompt out (`pipeline.retrieve` and
`pipeline.lay_out` for a question; `locate` for a framework's flat prompt string), then `gate` plans the answer
once and executes it, each attempt a `pipeline.run` (plan the loading, load, fuse), and generation decodes it.
"""
