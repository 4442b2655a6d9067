"""The delivery side of the contracts: a :class:`Transport` hands a request's deltas to a
consumer (an iterator, an async iterator, an HTTP stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from pipeline.engine import RequestHandle

Out_co = TypeVar('Out_co', covariant=True)


@runtime_checkable
class Transport(Protocol[Out_co]):
    """Delivers a request's deltas to a consumer, in order, and ends after the final one.

    ``deliver`` is called once per request handle, from the consumer's thread or event loop.
    If the consumer goes away before the final delta (an iterator is closed, a client
    disconnects), the transport calls ``handle.cancel()`` so the engine frees the slot.

    Example::

        for delta in InProcessTransport().deliver(pipe.submit("hi")):
            print(delta.text, end="")
    """

    name: str

    def deliver(self, handle: RequestHandle) -> Out_co:
        """Start delivering ``handle``'s deltas."""
        ...


SyncTransport = Transport[Iterator[Any]]
AsyncTransport = Transport[AsyncIterator[Any]]
