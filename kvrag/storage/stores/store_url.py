"""A store URL's query options, and URLs as kvrag shows them.

Contract: every store is opened by one grammar, ``scheme://location?option=value&...`` (`make_store`); the
store class the scheme names reads its own options from the query:

- `ByteStore.url_options` maps each option name the class takes to its parser (``max_bytes``: a size,
  `kvrag.sizes.parse_bytes`);
- `ByteStore.client_url_options` names the options left in the URL for the store's client library (redis-py's
  connection options for a ``redis://`` URL); none by default;
- any other option is refused in one line naming the store and what it takes, before anything is created.

`split_url_options` applies that to one URL: the URL with kvrag's options taken out, and those options parsed (the
last of a repeated option wins). `public_url` is a URL as messages and manifests show it: without its password.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

if TYPE_CHECKING:
    from kvrag.storage.stores.base import ByteStore


def public_url(url: str, mask: str = "***") -> str:
    """``url`` with its password (in the user part or a ``password=`` query field) replaced by ``mask``;
    with ``mask=""`` the password is left out altogether.
    """
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{mask}@{hostport}" if mask else (f"{user}@{hostport}" if user else hostport)
    query = parts.query
    if "password" in query:
        fields = [(k, mask if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)
                  if mask or k != "password"]
        query = urlencode(fields, safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # no password in it: as given (``memory://`` keeps its slashes)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def split_url_options(url: str, store: type[ByteStore]) -> tuple[str, dict[str, Any]]:
    """``(url without the options `store` takes, those options parsed)``; the client's options stay in the URL.

    Raises:
        ValueError: an option the store neither takes nor leaves to its client, or a value its parser refuses.
    """
    parts = urlsplit(url)
    if not parts.query:
        return url, {}
    client = store.client_url_options()
    taken: dict[str, Any] = {}
    left: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in store.url_options:
            try:
                taken[name] = store.url_options[name](value)
            except ValueError as exc:
                raise ValueError(f"store URL {public_url(url)}: {exc}") from None
        elif name in client:
            left.append((name, value))
        else:
            known = ", ".join(sorted(store.url_options))
            takes = f"it takes {known}" if known else "it takes none"
            more = " and its client's connection options" if client else ""
            raise ValueError(f"store URL {public_url(url)}: the {store.name!r} store takes no option {name!r} "
                             f"({takes}{more})")
    head, _, rest = url.partition("?")  # (not urlunsplit: it drops the ``//`` of an unknown scheme's empty host)
    fragment = rest.partition("#")[2]
    return head + (f"?{urlencode(left)}" if left else "") + (f"#{fragment}" if fragment else ""), taken
