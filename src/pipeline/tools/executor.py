"""Tool executors and authorization policies: the plugins at the reality boundary.

Owns the :class:`ToolExecutor` and :class:`ToolPolicy` Protocols, the executor's optional
capabilities :class:`KeyedExecutor` (it takes the call's idempotency key, so the world
downstream can deduplicate) and :class:`OutcomeLookup` (it can say what became of an in-doubt
call), :class:`FunctionTool` (a typed Python callable as an executor), the policy
:class:`Decision` with its :class:`Verdict`, and the built-in policies :class:`AllowAll` and
:class:`Rules`. Only an
executor crosses into the outside world (docs/design.md §11), and only after the boundary
(:mod:`pipeline.tools.boundary`) has parsed, validated, authorized and committed the call.
Third parties register executors and policies through ``pipeline_components`` (kinds
``tool`` and ``tool_policy``), as built-ins would.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from pipeline.errors import InvalidValueError
from pipeline.tools.ledger import Resolution
from pipeline.tools.schema import python_arguments, tool_spec
from pipeline.contracts.request import ToolSpec


@runtime_checkable
class ToolExecutor(Protocol):
    """Carries out one tool's calls: the only code that changes the world.

    ``spec`` is what the model sees (name, description, JSON schema of the arguments);
    ``execute`` is called at most once per idempotency key (the ledger's claim decides who
    may, across threads and processes), only with arguments that validated against
    ``spec.parameters``, on the thread that runs the tool loop. It returns a JSON value (the
    result the model reads) or raises (the call is then ``failed`` and the error is what the
    model reads). ``compensate`` undoes an executed call's effect when a caller asks for it
    explicitly (it may raise ``NotImplementedError``); what it returns is recorded as the
    compensation's own result, never as the call's.

    Two optional capabilities, each a Protocol of its own so an executor without them (and
    :class:`FunctionTool`) works unchanged:

    - :class:`KeyedExecutor`: with ``execute_keyed(arguments, key)`` the boundary calls it
      *instead of* ``execute``, passing the call's idempotency key, so a downstream API can
      deduplicate (an ``Idempotency-Key`` header, a unique request id). The key is the same
      for every retry of the call, in any process.
    - :class:`OutcomeLookup`: with ``lookup(key)`` the boundary asks it about a call in doubt
      (committed by a process that died before recording the outcome) and records the
      :class:`~pipeline.tools.ledger.Resolution` it returns.

    Example::

        class SendEmail:
            spec = ToolSpec("send_email", "Send an email.", {"type": "object", ...})
            def execute(self, arguments): return mailer.send(**arguments)
            def execute_keyed(self, arguments, key):
                return mailer.send(**arguments, idempotency_key=key)
            def lookup(self, key):
                sent = mailer.find(idempotency_key=key)
                return Resolution.executed(sent) if sent else None  # None: cannot tell
            def compensate(self, arguments, result): mailer.recall(result["id"])
    """

    @property
    def spec(self) -> ToolSpec:
        """The tool as the model sees it."""
        ...

    def execute(self, arguments: Mapping[str, Any]) -> Any:
        """Do it; return a JSON value."""
        ...

    def compensate(self, arguments: Mapping[str, Any], result: Any) -> Any:
        """Undo an executed call (an explicit, separate action); return a JSON value."""
        ...


@runtime_checkable
class KeyedExecutor(Protocol):
    """An executor that takes the idempotency key (optional capability of
    :class:`ToolExecutor`): the boundary calls ``execute_keyed`` instead of ``execute``, at
    most once per key, so the world downstream can deduplicate by the key too.

    Example::

        class Charge:
            def execute_keyed(self, arguments, key):
                return bank.charge(**arguments, idempotency_key=key)
    """

    def execute_keyed(self, arguments: Mapping[str, Any], key: str) -> Any:
        """Do it under ``key``; return a JSON value."""
        ...


@runtime_checkable
class OutcomeLookup(Protocol):
    """An executor that can say what became of a call (optional capability of
    :class:`ToolExecutor`). The boundary asks it about a key in doubt — committed, no
    outcome recorded, its holder gone — and records what it answers, so a retry returns it.
    ``lookup`` must have no effects; None means it cannot tell (the call stays in doubt), and
    an exception is taken as None.

    Example::

        class Charge:
            def lookup(self, key):
                found = bank.find_charge(idempotency_key=key)
                if found is None:
                    return None  # the bank cannot tell
                if found["ok"]:
                    return Resolution.executed(found)
                return Resolution.failed("declined")
    """

    def lookup(self, key: str) -> Resolution | None:
        """What became of the call under ``key``, if the world downstream knows."""
        ...


@attrs.frozen
class FunctionTool:
    """A typed Python function as a tool: its schema from its hints and docstring
    (:func:`~pipeline.tools.schema.tool_spec`); ``undo(result, **arguments)``, if given,
    compensates a call."""

    fn: Callable[..., Any]
    undo: Callable[..., Any] | None = None
    spec: ToolSpec = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "spec", tool_spec(self.fn))

    def execute(self, arguments: Mapping[str, Any]) -> Any:
        """Call the function with the arguments as its hints want them."""
        return self.fn(**python_arguments(self.fn, arguments))

    def compensate(self, arguments: Mapping[str, Any], result: Any) -> Any:
        """Call ``undo(result, **arguments)``."""
        if self.undo is None:
            raise NotImplementedError(f"tool {self.spec.name} has no compensation")
        return self.undo(result, **python_arguments(self.fn, arguments))


class Decision(enum.Enum):
    """A policy's answer for one call."""

    ALLOW = "allow"
    DENY = "deny"
    ASK = "ask"


@attrs.frozen
class Verdict:
    """A decision and why (the reason is recorded in the trace and, on a denial, told to
    the model)."""

    decision: Decision
    reason: str = ""


@runtime_checkable
class ToolPolicy(Protocol):
    """Decides whether a validated call may cross the commit boundary.

    ``decide`` sees the tool's name and its validated arguments; it must not have effects
    of its own. ``ASK`` defers to the ``ask`` callback the tool loop was given (no callback
    means no). Called on the tool loop's thread, once per call, after validation.

    Example::

        class NoBigTransfers:
            name = "no_big_transfers"
            def decide(self, tool, arguments):
                if tool == "transfer" and arguments["amount"] > 100:
                    return Verdict(Decision.ASK, "over 100")
                return Verdict(Decision.ALLOW)
    """

    name: str

    def decide(self, tool: str, arguments: Mapping[str, Any]) -> Verdict:
        """The verdict for calling ``tool`` with ``arguments``."""
        ...


class AllowAll:
    """Allows every call to a tool the caller offered (the default)."""

    name = "allow_all"

    def decide(self, tool: str, arguments: Mapping[str, Any]) -> Verdict:
        """Always allow."""
        return Verdict(Decision.ALLOW, "every offered tool is allowed")


Rule = Decision | Callable[[Mapping[str, Any]], Decision | Verdict]


class Rules:
    """A decision per tool name, fixed or computed from the arguments; ``default`` for
    tools without a rule."""

    name = "rules"

    def __init__(self, rules: Mapping[str, Rule], default: Decision = Decision.DENY) -> None:
        for tool, rule in rules.items():
            if not (isinstance(rule, Decision) or callable(rule)):
                raise InvalidValueError(f"rules[{tool}]", rule, "must be a Decision or a "
                                        "function of the arguments")
        self._rules = dict(rules)
        self._default = default

    def decide(self, tool: str, arguments: Mapping[str, Any]) -> Verdict:
        """The rule's verdict for ``tool``."""
        rule = self._rules.get(tool)
        if rule is None:
            return Verdict(self._default, f"no rule for {tool}")
        answer = rule if isinstance(rule, Decision) else rule(arguments)
        return answer if isinstance(answer, Verdict) else Verdict(answer, f"rule for {tool}")
