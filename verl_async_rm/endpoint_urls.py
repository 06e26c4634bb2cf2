"""The base URLs of a remote RM (``endpoint``), checked where the settings are read: :func:`check_endpoints`. Below
the RM settings (``scoring/rm_config.py``) and the endpoint client (``remote/``), which both use it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import httpx

from verl_async_rm.errors import ConfigTypeError, ConfigValueError

__all__ = ["check_endpoints"]

#: Routes of the API the client appends to a base URL: a configured URL ending with one is a route, not a base URL.
_API_ROUTES = ("/chat/completions", "/completions", "/classify", "/models", "/embeddings", "/score", "/rerank",
               "/pooling")
#: The names of this machine for a server on it.
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

def check_endpoints(urls: str | Sequence[str], key: str = "urls") -> tuple[str, ...]:
    """The base URLs (one, or a non-empty list), checked and without a trailing slash; raises ``ConfigValueError``
    (a ``ValueError``) under ``key`` naming the bad value and the fix: a URL without http(s) or a host, with
    credentials, a query or a fragment, one that ends with an API route (``/chat/completions``...), one listed twice
    (``localhost``, ``127.0.0.1`` and ``::1`` on one port are one server)."""
    items = [urls] if isinstance(urls, str) else urls
    if isinstance(items, bytes | Mapping) or not isinstance(items, Sequence) or len(items) == 0:
        raise ConfigValueError(key, urls, "needs at least one base URL",
                               "give a list of base URLs such as ['http://127.0.0.1:8000/v1']")
    out: list[str] = []
    seen: dict[tuple, str] = {}
    for url in items:
        if not isinstance(url, str) or not url.strip():
            raise ConfigTypeError(key, url, "each entry must be a non-empty string", "write each base URL as text")
        try:
            parsed = httpx.URL(url.strip())
        except httpx.InvalidURL as err:
            raise ConfigValueError(key, url, f"is not a URL ({err})", "write it as http(s)://host:port/v1") from None
        if parsed.userinfo:
            shown = str(parsed.copy_with(username=None, password=None)).replace("://", "://***@", 1)
            raise ConfigValueError(key, shown, "holds credentials, which would travel and be logged with the URL",
                                   "drop them from the URL; put the key in an environment variable named by "
                                   "api_key_env")
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigValueError(key, url, "needs a scheme (http:// or https://) and a host",
                                   f"write it as {_with_scheme(url.strip())} (or https://)")
        if parsed.query or parsed.fragment:
            raise ConfigValueError(key, url, "must not have a query or a fragment", "give the base URL only")
        path = parsed.path.rstrip("/")
        route = next((r for r in _API_ROUTES if path.endswith(r)), None)
        if route is not None:
            base = str(parsed.copy_with(path=path[: -len(route)] or "/v1")).rstrip("/")
            raise ConfigValueError(key, url, f"ends with the API route {route}, which the client adds itself",
                                   f"give the base URL, {base}")
        norm = str(parsed.copy_with(path=path))
        # one server under several names (localhost, 127.0.0.1, ::1) is one endpoint: listed twice, it would be
        # counted as two for routing and cool-downs
        same = (parsed.scheme, "localhost" if parsed.host in _LOOPBACK_NAMES else parsed.host,
                parsed.port or (443 if parsed.scheme == "https" else 80), path)
        if same in seen:
            raise ConfigValueError(key, url, f"is listed twice (as {seen[same]} before)", "list each endpoint once")
        seen[same] = norm
        out.append(norm)
    return tuple(out)


def _with_scheme(url: str) -> str:
    """``url`` with ``http://`` for its scheme: the host and the rest kept when it has a host (``localhost:8000/v1``,
    ``ftp://h/v1``), else the shape of a base URL (``file:///x``)."""
    rest = url.split("://", 1)[-1] if "://" in url else re.sub(r"^https?:?/+", "", url, flags=re.IGNORECASE)
    try:
        fixed = httpx.URL("http://" + rest)
    except httpx.InvalidURL:
        fixed = None
    if not rest or rest.startswith("/") or fixed is None or fixed.userinfo or not fixed.host:
        return "http://<host>:<port>/v1"
    return str(fixed) if fixed.path not in ("", "/") else str(fixed.copy_with(path="/v1"))
