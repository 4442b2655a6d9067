"""The length rule's one home: how many more tokens a request may have.

Owns :func:`room` and :func:`window`. A request ends with ``length`` when its outputs reach
``max_tokens`` or its prompt and outputs fill the context window; whatever plans ahead of that
end asks :func:`room` how far it leaves it: each strategy sizing its next block or its drafts,
the grammar keeping a constrained output closable, the ``max_tokens`` stopper, and the
server's window fit, thinking guard and document cut.

Example::

    room(16, generated=10)                                  # 6: max_tokens leaves six
    room(16, generated=10, window=32, held=28, block=8)     # 4: the window leaves four
"""


def room(max_tokens: int, generated: int, *, window: int | None = None, held: int = 0,
         block: int | None = None) -> int:
    """Tokens a request may still commit: what ``max_tokens`` leaves after ``generated``
    outputs, no more than the ``window`` (when given) holds after the ``held`` positions the
    cache has, and at most ``block`` (a step's own cap). Zero or less: the request is done."""
    left = max_tokens - generated
    if window is not None:
        left = min(left, window - held)
    return left if block is None else min(left, block)


def window(model: int, limit: int | None) -> int:
    """The context window a request has: the ``model``'s, or a smaller ``limit`` (the
    request's ``max_context_tokens``, the server's ``max_context``)."""
    return model if limit is None else min(model, limit)
