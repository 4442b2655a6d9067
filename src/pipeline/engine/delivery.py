"""What the caller receives of a request: its deltas, in order, on its handle.

Owns :class:`Delivery`, one of the three parts of a :class:`~pipeline.engine.job.Job` (beside
its scheduling state and its :class:`~pipeline.engine.recorder.Recorder`). It takes each
committed token through the request's :class:`~pipeline.engine.text_state.TextState`
(stoppers, detokenizer), types the released text once (thinking, answer text, tool calls:
:mod:`pipeline.output_parts`), records the ``tool.*`` and ``stream.delta`` events, and pushes
the :class:`~pipeline.contracts.output.Delta` to the :class:`~pipeline.engine.handle.RequestHandle`.
Text a stopper holds back rides on a later delta; a verdict always closes the stream.

Example::

    delivery = Delivery(text, handle, recorder)
    verdict = delivery.commit(token, logprob, verdict, step=1, parent=selected)
    delivery.close(FinishReason.CANCELLED, step=1)      # flush what is held, end the stream
"""

from __future__ import annotations

from pipeline.engine.handle import RequestHandle
from pipeline.engine.recorder import Recorder
from pipeline.engine.text_state import TextState
from pipeline.contracts.text import StopVerdict
from pipeline.contracts.output import FinishReason, TokenLogprob


class Delivery:
    """A request's text side and its handle. Engine thread only."""

    def __init__(self, text: TextState, handle: RequestHandle, recorder: Recorder) -> None:
        self.text = text
        self.handle = handle
        self._recorder = recorder

    def commit(self, token: int, logprob: TokenLogprob | None, verdict: StopVerdict | None,
               step: int, parent: int) -> StopVerdict | None:
        """Take committed output token ``step`` (``verdict``: a stopper's or the window's);
        deliver what it releases (as a child of event ``parent``, its selection). Returns
        the verdict that ends the request, if any (a stop string in the text wins)."""
        released, verdict = self.text.commit(token, logprob, verdict)
        if released or verdict is not None:
            self.push(released, verdict.reason if verdict is not None else None, step, parent)
        return verdict

    def close(self, reason: FinishReason, step: int) -> None:
        """End the stream outside the token path (cancel, deadline, failure): what is held
        back goes out with ``reason`` on the last delta."""
        self.push("", reason, step)

    def push(self, text: str, reason: FinishReason | None, step: int,
             parent: int | None = None) -> None:
        """One delta of ``text`` (``reason`` on the last), with its typed parts."""
        parts = tuple(self.text.split(text, reason is not None))
        self._recorder.tool_parts(parts)
        delta = self.text.delta(text, reason, parts)
        self._recorder.delta(delta.seq, step, text, len(delta.token_ids), reason is not None,
                             parent)
        self.handle._push(delta)
