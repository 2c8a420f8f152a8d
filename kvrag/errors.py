"""kvrag's exception hierarchy: everything a caller may want to catch derives from KVRagError."""

from __future__ import annotations


class KVRagError(Exception):
    """Base class of every kvrag-specific error."""


class IndexMismatchError(KVRagError):
    """An index was opened with a model (or embedder) other than the one that built it."""


class UntrustedPathError(KVRagError):
    """An index names a local path outside itself to load code or weights from; kvrag loads it only when the
    caller names that path too.
    """


class IndexNotFoundError(KVRagError):
    """The directory holds no kvrag index."""


class IndexCorruptError(KVRagError):
    """A file of an index is damaged, missing or unsafe; the message names the file, the problem and the fix.

    Attributes:
        file: the damaged file (or folder).
        problem: what is wrong with it.
        fix: the command or step that repairs it (by default ``kvrag repair INDEX``).
    """

    def __init__(self, file: object, problem: str, index: object = None, fix: str | None = None) -> None:
        self.file, self.problem = str(file), problem
        self.fix = fix if fix is not None else (f"run 'kvrag repair {index}'" if index is not None else "")
        super().__init__(f"{self.file}: {problem}" + (f"; {self.fix}" if self.fix else ""))


class ChunkNotFoundError(KVRagError, KeyError):
    """A chunk key that the index does not hold: a key from another index, or a row lost from a damaged
    ``chunks.sqlite``. Also a `KeyError`, which an unknown key raised before; its text is the plain message.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptChunkError(KVRagError):
    """A stored chunk cache failed its integrity checks; it must be recomputed from text."""

    def __init__(self, chunk: str, reason: str) -> None:
        super().__init__(f"chunk {chunk}: {reason}")
        self.chunk = chunk
        self.reason = reason


class ModelNotFoundError(KVRagError, FileNotFoundError):
    """No model under the name given: not a local folder or GGUF file, nor a hub id that can be loaded.

    Also a `FileNotFoundError` (an `OSError`), which is what loading a missing model raised before.
    """


class UnsupportedModelError(KVRagError):
    """The model's architecture or RoPE variant cannot be fused position-independently."""


class InputError(KVRagError, ValueError):
    """Bad user input (empty documents, empty question, prompt longer than the context...)."""


class StoreUnavailableError(KVRagError):
    """A chunk store could not be reached or did not answer; the message names it without its password."""


class ChunkUnavailableError(CorruptChunkError):
    """A chunk's cache could not be read because its store is unreachable: not damaged, not known to be absent.

    It is recovered like a damaged cache (computed from the chunk's text), but the store has already warned
    once for the whole outage, so recoveries log it at debug level (`kvrag.storage.kvstore.log_recovery`).
    """
