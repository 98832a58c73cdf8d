"""The checks a web server of this package makes, for the browser's sake, before a request reaches its app: `serve`
and the studio wrap their apps in the same BrowserGuard.

A page on any site can make the user's browser send requests to a server on this machine. Two ways in, two checks:
- DNS rebinding: the page's own name is made to resolve to 127.0.0.1, so its requests reach the server as
  same-origin ones and it can read the answers. The Host header still carries the page's name, so a request must
  name this machine: its loopback names, the address the server is bound to, and, for a server bound to an address
  other machines reach, this machine's host names and the addresses of its interfaces.
- Cross-site requests: a form on any site can POST to the server (form and text/plain bodies need no CORS
  preflight). A request that may change something (any method but GET and HEAD) is refused when its Origin is not
  the server's own, or when the browser marks it as coming from another site (Sec-Fetch-Site). Clients other than
  browsers (the openai client, curl, scripts) send neither header and pass.

A refusal is a 403 in the app's own error shape, and a warning in its log.
"""

from __future__ import annotations

import logging
import socket
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit

import psutil
from starlette.datastructures import Headers
from starlette.responses import Response

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SAFE_METHODS = ("GET", "HEAD")
CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site values of a request from a page of another origin


def name_of(host: str) -> Optional[str]:
    """The host name a Host header (or a bind address) gives, lower case, without its port and a final dot; None
    when it is not a host at all ("[::1" and the like)."""
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


def origin_of(url: str) -> Optional[tuple[str, Optional[int]]]:
    """(host name, port) of an Origin header, or of `//` + a Host header; None when it names no host."""
    try:
        parts = urlsplit(url)
        return (parts.hostname.rstrip("."), parts.port) if parts.hostname else None
    except ValueError:
        return None


def machine_names() -> set[str]:
    """The names other machines may reach this one by: its host names and the addresses of its interfaces."""
    names = {socket.gethostname(), socket.getfqdn()}
    for addresses in psutil.net_if_addrs().values():
        names.update(address.address.split("%")[0] for address in addresses
                     if address.family in (socket.AF_INET, socket.AF_INET6))
    return {name.lower().rstrip(".") for name in names if name}


def allowed_hosts(bound: str) -> frozenset[str]:
    """The names a request's Host header may give for a server bound to `bound`."""
    bound_name = name_of(bound if ":" not in bound or bound.startswith("[") else f"[{bound}]")
    names = {*LOCAL_HOSTS, *([bound_name] if bound_name else [])}
    if bound_name not in LOCAL_HOSTS:  # reachable from other machines, by whatever name they know this one by
        names |= machine_names()
    return frozenset(names)


class BrowserGuard:
    """ASGI middleware: the Host and Origin checks above, before anything else of the app runs. `refuse(status,
    message)` is the app's error response; `log` gets a warning line per refusal."""

    def __init__(self, app, hosts: Iterable[str], refuse: Callable[[int, str], Response], log: logging.Logger):
        self.app, self.hosts, self.refuse, self.log = app, frozenset(hosts), refuse, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = self.problem(scope)
        if problem is None:
            return await self.app(scope, receive, send)
        self.log.warning("403 %s %s refused: %s", scope["method"], scope["path"], problem)
        return await self.refuse(403, problem)(scope, receive, send)

    def problem(self, scope) -> Optional[str]:
        """Why the request is refused, in one line; None when it passes."""
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if name_of(host) not in self.hosts:
            return (f"host {host!r}: this server answers requests addressed to this machine only (as "
                    f"{', '.join(LOCAL_HOSTS[:2])} or the address it was started on)")
        if scope["method"] in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        if origin is not None and origin_of(origin) != origin_of(f"//{host}"):
            return f"origin {origin!r}: requests that change something must come from this server's own page"
        site = headers.get("sec-fetch-site")
        if site in CROSS_SITE:
            return f"sec-fetch-site {site!r}: requests that change something must come from this server's own page"
        return None
