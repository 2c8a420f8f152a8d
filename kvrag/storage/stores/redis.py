"""The ``redis`` store (alias ``rediss``, over TLS): chunk caches in a shared Redis or Valkey, one key per blob.

Contract:

- ``RedisStore(url, namespace)`` keeps blob ``k`` under the Redis key ``namespace + k`` in the database the
  URL names, ``redis://[[USER]:PASSWORD@]HOST:PORT/DB``. A ``put`` is one ``SET`` of the whole blob, so a
  reader sees the old blob or the new one, never a mix, and writers of one key in several processes leave
  one whole blob (keys are content hashes: they write the same bytes). ``open`` returns an in-memory file
  of the blob; the container's checksums check it like any other (`kvrag.storage.kvstore`).
- redis-py is imported when a store is made; without it the error says ``pip install kvrag[redis]``.
- Every command has a connect timeout and a socket timeout, and is tried again ``retries`` times with
  exponential backoff after a connection error (refused, reset); a timeout is not tried again, as a server
  that does not answer in time is not helped by more load. A command that still fails raises
  `StoreUnavailableError` naming the URL without its password; for ``retry_after_s`` seconds after a
  connection failure the store fails at once with the same error instead of waiting on the network again,
  so an unreachable store costs one round of timeouts, not one per chunk.
- A URL without a password takes the one in the environment variable ``KVRAG_REDIS_PASSWORD`` when it is
  set: an index's manifest records its store's URL without the password.
- It is a network store (``network = True``): `make_store` builds it from its URL
  (``make_store("redis://host:6379/0", namespace=...)``) or by name with ``url=``; an index opens it through
  `kvrag.storage.stores.index_store.open_index_store`, behind a local cache.
- ``sizes`` asks for many blobs' sizes in one pipelined round trip (``STRLEN``); ``keys`` lists the keys under
  the namespace with ``SCAN`` (never ``KEYS``, which blocks the server).
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar
from urllib.parse import unquote

from kvrag.errors import StoreUnavailableError
from kvrag.sizes import parse_bytes
from kvrag.storage.stores.base import ByteStore, register_store
from kvrag.storage.stores.store_url import public_url

T = TypeVar("T")
PASSWORD_ENV = "KVRAG_REDIS_PASSWORD"
_HEX = frozenset("0123456789abcdef")


def _redis() -> Any:
    """The redis module (with its ``backoff`` and ``retry``), or ImportError in one line naming the extra to install."""
    try:
        # redis-py is an optional extra that takes ~0.25 s to import, and this module is imported with every
        # store's registration: it loads when a Redis store is made (and a missing one is reported then)
        import redis.backoff
        import redis.retry  # (as above) the client's retry policy
    except ImportError:
        raise ImportError("the redis chunk store needs redis-py: pip install kvrag[redis]") from None
    return redis


@functools.cache
def _client_options() -> frozenset[str]:
    """The query options redis-py reads from a URL: those it parses, and its connections' keyword arguments."""
    connection = _redis().connection
    names = set(getattr(connection, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for kind in (connection.AbstractConnection, connection.Connection, connection.SSLConnection):
        names.update(inspect.signature(kind.__init__).parameters)
    return frozenset(names - {"self", "args", "kwargs"})


@register_store("redis", "rediss")
class RedisStore(ByteStore):
    """Blobs in a Redis (or Valkey) database under ``namespace + key``; see the module's contract.

    Args:
        url: ``redis://[[USER]:PASSWORD@]HOST:PORT/DB`` (``rediss://`` for TLS; redis-py's query options work).
        namespace: the prefix of this store's keys (an index's own: `kvrag.storage.stores.index_store.store_record`).
        connect_timeout_s, timeout_s: the connect timeout and the timeout of each command.
        retries: further tries of a command after a connection error, with exponential backoff.
        retry_after_s: after a connection failure, how long the store fails at once without asking the server.
    """

    network = True  # located by its URL: make_store("redis://host:port/db") builds it
    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {"max_bytes": parse_bytes}
    bounded: ClassVar[str] = "bounded-redis"

    @classmethod
    def client_url_options(cls) -> frozenset[str]:
        """redis-py's connection options, which a ``redis://`` URL's query may carry (``?socket_keepalive=1``)."""
        return _client_options()

    def __init__(self, url: str, namespace: str = "kvrag:", *, connect_timeout_s: float = 1.0, timeout_s: float = 5.0,
                 retries: int = 2, retry_after_s: float = 5.0) -> None:
        redis = _redis()
        self.url, self.namespace = public_url(url), namespace
        self.retry_after_s = float(retry_after_s)
        given, secret = _password(url), os.environ.get(PASSWORD_ENV)
        extra = {"password": secret} if secret and given is None else {}
        self._secrets = [s for s in (given, unquote(given or ""), secret) if s]
        try:
            self._client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                retry=redis.retry.Retry(redis.backoff.ExponentialBackoff(cap=1.0, base=0.05), retries,
                                        (redis.exceptions.ConnectionError,)),
                **extra)
        except ValueError as exc:
            raise ValueError(f"store URL {self.url}: {self._scrub(str(exc))}") from None
        self._errors = (redis.exceptions.RedisError, OSError)
        self._login_errors = (redis.exceptions.AuthenticationError,
                              getattr(redis.exceptions, "AuthorizationError", redis.exceptions.AuthenticationError))
        self._connection_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down_why = ""

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> RedisStore:
        """A store at ``options["url"]``; other options as the constructor's. ``root`` must be None."""
        if root is not None:
            raise ValueError(f"the {cls.name!r} store takes a url=, not a root directory ({root})")
        if "url" not in options:
            raise ValueError(f"the {cls.name!r} store needs url='redis://HOST:PORT/DB'")
        return cls(**options)

    def _key(self, key: str) -> str:
        if not key or not _HEX.issuperset(key):
            raise ValueError(f"chunk key must be lowercase hex, got {key!r}")
        return self.namespace + key

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _call(self, what: str, command: Callable[[], T]) -> T:
        """Run one command; `StoreUnavailableError` naming the store when it fails (see the contract)."""
        with self._lock:
            down, why = time.monotonic() < self._down_until, self._down_why
        if down:
            raise StoreUnavailableError(why)
        try:
            return command()
        except self._errors as exc:
            detail = " ".join(self._scrub(str(exc)).split())[:200] or "no answer"
            if isinstance(exc, self._login_errors):
                why = (f"{self.url} refused the login ({type(exc).__name__}: {detail}); give the password in the "
                       f"store URL or in {PASSWORD_ENV}")
            elif isinstance(exc, self._connection_errors):
                why = f"{self.url} is unreachable ({type(exc).__name__}: {detail})"
            else:
                why = f"{self.url}: {what} failed ({type(exc).__name__}: {detail})"
            if isinstance(exc, self._connection_errors):  # also a refused login: no use asking again at once
                with self._lock:
                    self._down_until, self._down_why = time.monotonic() + self.retry_after_s, why
            raise StoreUnavailableError(why) from None

    def ping(self) -> None:
        """Ask the server for an answer: `StoreUnavailableError` when none comes."""
        self._call("PING", self._client.ping)

    def put(self, key: str, data: bytes) -> None:
        """``SET`` the whole blob: atomic for readers and other writers."""
        name = self._key(key)
        self._call("SET", lambda: self._client.set(name, bytes(data)))

    def open(self, key: str) -> BinaryIO | None:
        """``GET`` the blob into memory; None when absent."""
        name = self._key(key)
        data = self._call("GET", lambda: self._client.get(name))
        return None if data is None else io.BytesIO(data)

    def contains(self, key: str) -> bool:
        """``EXISTS``."""
        name = self._key(key)
        return bool(self._call("EXISTS", lambda: self._client.exists(name)))

    def nbytes(self, key: str) -> int:
        """``STRLEN``: the blob's size (0 when absent)."""
        name = self._key(key)
        return int(self._call("STRLEN", lambda: self._client.strlen(name)))

    def sizes(self, keys: Iterable[str]) -> list[int]:
        """``STRLEN`` of every key in one pipelined round trip (0 for an absent one)."""
        names = [self._key(k) for k in keys]
        if not names:
            return []

        def ask() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return [int(n) for n in pipe.execute()]

        return self._call("STRLEN", ask)

    def keys(self) -> Iterator[str]:
        """The keys under the namespace (without it), by ``SCAN``."""
        pattern = _glob_escape(self.namespace) + "*"
        found = self._call("SCAN", lambda: [k.decode() for k in self._client.scan_iter(match=pattern, count=1000)])
        return iter(sorted(k[len(self.namespace):] for k in found))

    def delete(self, key: str) -> None:
        """``DEL``."""
        name = self._key(key)
        self._call("DEL", lambda: self._client.delete(name))

    def close(self) -> None:
        """Close the client's connections."""
        try:
            self._client.close()
        except self._errors:  # closing a client whose server is gone is no error
            pass


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _password(url: str) -> str | None:
    """The password written in ``url`` (user part), as given."""
    userinfo, at, _ = url.partition("://")[2].split("/", 1)[0].rpartition("@")
    return userinfo.split(":", 1)[1] if at and ":" in userinfo else None
