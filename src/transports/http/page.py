"""The web chat page served at ``GET /`` (DESIGN §14).

Owns :class:`ChatPage`: the package's one self-contained HTML file (``web/index.html``: inline
CSS and JavaScript, no external URL, so it works offline; what the page does is written at its
top) and the headers it is served with. The page holds nothing private and needs no key to
load; it asks the user for a key and sends it with each API call. Its Content-Security-Policy
lets it run only its own inline ``<script>`` and ``<style>`` (allowed by their sha256, computed
here when the server starts, rather than by ``'unsafe-inline'``) and talk only to this server.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from importlib import resources

import attrs

PAGE = "web/index.html"
MEDIA_TYPE = "text/html; charset=utf-8"
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
    return "; ".join((
        "default-src 'none'",
        f"script-src {_hashes(html, 'script')}",
        f"style-src {_hashes(html, 'style')}",
        "connect-src 'self'",
        "img-src data:",  # the empty icon, so the browser asks for no /favicon.ico
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ))


@attrs.frozen
class ChatPage:
    """The page's bytes and the headers that go with them."""

    body: bytes
    headers: Mapping[str, str]

    @classmethod
    def load(cls) -> ChatPage:
        """Read the page from the package's data."""
        html = resources.files("transports.http").joinpath(PAGE).read_text(encoding="utf-8")
        return cls(html.encode("utf-8"), {
            "content-security-policy": content_security_policy(html),
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
            "x-frame-options": "DENY",
            "cache-control": "no-cache",
        })
