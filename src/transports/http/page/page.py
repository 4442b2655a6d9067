"""The web chat page served at ``GET /`` and its scripts at ``GET /web/{name}``
(docs/design.md §14).

Owns :class:`ChatPage`: the package's HTML file (``web/index.html``: inline CSS and a small
inline loader; what the page does is written at its top), the scripts it loads from this
server (:data:`ASSETS`: the vendored Markdown renderer, sanitizer and highlighter in
``web/vendor/``, whose ``README.md`` names their versions and licences, then the page's own
``inspector.js`` and ``chat.js``), and the headers they are served with; and
:func:`asset_handler`. Nothing comes from elsewhere, so the page works offline. The page holds
nothing private and needs no key to load; it asks the user for a key and sends it with each
API call. Its Content-Security-Policy lets it run only its own inline ``<script>`` and
``<style>`` (allowed by their sha256, computed here when the server starts, rather than by
``'unsafe-inline'``) and, through ``'strict-dynamic'``, the scripts that loader adds: each
pinned by its SHA-384 (Subresource Integrity, computed here too and written into the page),
so no other script runs; and it talks only to this server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources

import attrs
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

PAGE = "web/index.html"
MEDIA_TYPE = "text/html; charset=utf-8"
SCRIPT_TYPE = "text/javascript; charset=utf-8"
ASSETS = {"purify.min.js": "vendor/purify.min.js", "marked.min.js": "vendor/marked.min.js",
          "highlight.min.js": "vendor/highlight.min.js", "inspector.js": "inspector.js",
          "chat.js": "chat.js"}
"""The scripts the page loads, by their name in ``/web/{name}`` (their files under ``web/``),
in the order they run."""
ASSET_PATH = "/web/"
_MANIFEST = re.compile(r'(<script type="application/json" id="assets">)(.*?)(</script>)',
                       re.DOTALL)
_INLINE = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ("script", "style")}
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def _hashes(html: str, tag: str) -> str:
    """The CSP sources allowing each inline ``<tag>`` of ``html`` by its sha256."""
    blocks = _INLINE[tag].findall(_COMMENT.sub("", html))
    if not blocks:
        raise ValueError(f"{PAGE} has no inline <{tag}>")
    return " ".join("'sha256-{}'".format(
        base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()) for b in blocks)


def content_security_policy(html: str) -> str:
    """A policy for ``html``: its inline script and style only, requests to this origin only,
    no plugins, frames, forms or base URL of elsewhere."""
    return "; ".join((  # 'strict-dynamic': what the hashed loader adds (with SRI) may run
        "default-src 'none'",
        f"script-src {_hashes(html, 'script')} 'strict-dynamic'",
        f"style-src {_hashes(html, 'style')}",
        "connect-src 'self'",
        "img-src data:",  # the empty icon, so the browser asks for no /favicon.ico
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ))


@attrs.frozen
class ChatPage:
    """The page's bytes and the headers that go with them, and its scripts by name."""

    body: bytes
    headers: Mapping[str, str]
    assets: Mapping[str, bytes] = attrs.field(factory=dict)

    @classmethod
    def load(cls) -> ChatPage:
        """Read the page and its scripts from the package's data; the page's manifest of
        scripts gets each one's path and SHA-384 integrity."""
        web = resources.files("transports.http.page").joinpath("web")
        assets = {name: web.joinpath(path).read_bytes() for name, path in ASSETS.items()}
        html = with_manifest(resources.files("transports.http.page").joinpath(PAGE)
                             .read_text(encoding="utf-8"), assets)
        return cls(html.encode("utf-8"), {
            "content-security-policy": content_security_policy(html),
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
            "x-frame-options": "DENY",
            "cache-control": "no-cache",
        }, assets)


def integrity(data: bytes) -> str:
    """The Subresource Integrity value of ``data`` (``sha384-`` and its base64 digest)."""
    return "sha384-" + base64.b64encode(hashlib.sha384(data).digest()).decode()


def with_manifest(html: str, assets: Mapping[str, bytes]) -> str:
    """``html`` with its ``<script type="application/json" id="assets">`` filled in: the
    scripts' paths and integrity values, in load order (JSON, so no markup can appear)."""
    manifest = json.dumps([{"src": ASSET_PATH + name, "integrity": integrity(data)}
                           for name, data in assets.items()])
    filled, count = _MANIFEST.subn(lambda m: m.group(1) + manifest + m.group(3), html)
    if count != 1:
        raise ValueError(f"{PAGE} needs exactly one assets manifest, not {count}")
    return filled


def asset_handler(page: ChatPage) -> Callable[[HTTPRequest], Awaitable[Response]]:
    """The handler of ``GET /web/{name}``: one of the page's scripts (no key needed), or
    404 for any other name."""
    headers = {"x-content-type-options": "nosniff", "cache-control": "no-cache",
               "cross-origin-resource-policy": "same-origin"}

    async def asset(http: HTTPRequest) -> Response:
        data = page.assets.get(http.path_params["name"])
        if data is None:
            raise HTTPException(404)
        return Response(data, media_type=SCRIPT_TYPE, headers=headers)

    return asset
