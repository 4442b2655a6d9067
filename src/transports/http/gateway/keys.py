"""API keys: which requests the server answers.

Owns :class:`Keys`, compared in constant time. ``Authorization: Bearer KEY`` and ``x-api-key:
KEY`` are both accepted. When a request sends both (or repeats one), every value must be a
valid key: a wrong one is a 401 naming the header it came in (the one the client used: the
OpenAI SDK sends ``Authorization``, the Anthropic SDK ``Authorization`` or ``x-api-key`` by
version and settings), never ignored because another is right. An ``Authorization`` header of
another scheme is a 401. :meth:`Keys.authenticate` returns the fingerprints of the keys a
request sent; a request's trace is readable with those keys only
(:mod:`transports.http.accounting.traces`).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Sequence

from transports.http.serving_errors import AuthenticationError
from transports.http.accounting.traces import key_fingerprint


def _values(header: str | Sequence[str] | None) -> list[str]:
    """A header's values: none, one, or each of a repeated header."""
    if header is None:
        return []
    return [header] if isinstance(header, str) else list(header)


class Keys:
    """The server's API keys (none: every request is let in)."""

    def __init__(self, keys: Collection[str]) -> None:
        self.keys = keys

    def authenticate(self, authorization: str | Sequence[str] | None,
                     api_key: str | Sequence[str] | None) -> frozenset[str]:
        """Accept the request's keys or raise; returns their fingerprints (empty when the
        server has no keys). Each header may be given once or repeated (a sequence of its
        values): every value sent must be a valid key."""
        if not self.keys:
            return frozenset()
        sent: list[tuple[str, str]] = []
        for value in _values(authorization):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer":
                raise AuthenticationError("Authorization header: only the Bearer scheme is "
                                          "accepted (Authorization: Bearer <key>)")
            sent.append(("Authorization", token.strip()))
        sent.extend(("x-api-key", value.strip()) for value in _values(api_key))
        if not any(key for _, key in sent):
            raise AuthenticationError("missing API key: send Authorization: Bearer <key> "
                                      "or x-api-key")
        wrong = list(dict.fromkeys(h for h, given in sent if not self._valid(given)))
        if wrong:  # every key sent must be valid: say which header (the client's) held one
            where = " and ".join(wrong)
            raise AuthenticationError(f"invalid API key in the {where} header"
                                      f"{'s' * (len(wrong) > 1)}: it is not one of this "
                                      "server's keys")
        return frozenset(key_fingerprint(key) for _, key in sent if key)

    def _valid(self, given: str) -> bool:
        match = False
        for key in self.keys:  # compare with all, in constant time each
            match |= hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())
        return match
