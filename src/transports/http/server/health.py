"""What the server says about its own state, to strangers and to its operator.

Owns :func:`public_health` (``GET /health``, no key needed: a load balancer's probe),
:func:`operator_health` (``GET /health/details``, behind the API keys like every other
endpoint). Nothing about one client may reach another: the public answer carries each
model's state and, for each worker that is down, only a *class* of reason
(:func:`~transports.http.serving_errors.failure_class`: ``stalled``, ``unresponsive``, ``engine_stopped``,
``rank_lost``; or ``load_failed``, ``usage_store_down``), never the text of a failure, which
may describe the requests of the moment; that text goes to the operator's endpoint and to
the log. The 503 a client gets while an engine restarts names the class too
(:class:`~transports.http.serving_errors.ModelLoadingError`).

Both answers are 200 when every model is loaded and its engine runs, else 503, with
``status`` one of ``ok``, ``failed`` (a model failed to load, or to get a fresh engine),
``engine_stopped`` (a stopped engine waits for a fresh one), ``loading``, ``degraded`` (only a
usage store is down: answers still flow, their records wait in memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transports.http.serving_errors import failure_class

if TYPE_CHECKING:
    from transports.http.gateway.gateway import Gateway

def _states(gateway: Gateway) -> tuple[dict[str, str], dict[str, str], str, bool]:
    """Each model's state, each stopped engine's failure, the overall status, and ok."""
    from transports.http.gateway.models import ModelState

    states, failures = {}, {}
    for name, m in gateway.models.items():
        failure = m.engine_failure if m.state is ModelState.READY else None
        states[name] = "restarting" if failure is not None else m.state.value
        if failure is not None:
            failures[name] = failure
    ok = gateway.ready
    loading = any(m.state is ModelState.LOADING for m in gateway.models.values())
    status = ("ok" if ok else "failed" if gateway.failed else "engine_stopped" if failures
              else "loading" if loading else "degraded")
    return states, failures, status, ok


def public_health(gateway: Gateway) -> tuple[dict[str, Any], int]:
    """``GET /health``'s body and status: ``status``, ``models`` (each one's state) and, when
    something is down, ``reasons``: a reason class by worker (``engine:<model>``,
    ``model:<model>``, ``usage_store``)."""
    states, failures, status, ok = _states(gateway)
    body: dict[str, Any] = {"status": status, "models": states}
    reasons = {f"engine:{name}": failure_class(why) for name, why in failures.items()}
    reasons.update({f"model:{name}": gateway.models[name].error_class
                    for name in gateway.failed})
    if gateway.usage.health().down is not None:
        reasons["usage_store"] = "usage_store_down"
    if reasons:
        body["reasons"] = reasons
    return body, 200 if ok else 503


def operator_health(gateway: Gateway) -> tuple[dict[str, Any], int]:
    """``GET /health/details``: the public answer plus why — ``engine_failures`` (why each
    stopped engine stopped), ``model_failures`` (why a model failed to load or to get a fresh
    engine), ``restarts`` (fresh engines per model, once there were any) and ``problems``
    (every worker that is down, with why)."""
    body, code = public_health(gateway)
    _, failures, _, _ = _states(gateway)
    if gateway.failed:
        body["model_failures"] = gateway.failed
    restarts = {n: m.restarts for n, m in gateway.models.items() if m.restarts}
    if restarts:
        body["restarts"] = restarts
    if failures:
        body["engine_failures"] = failures
    problems = gateway.problems()
    if problems:
        body["problems"] = problems
    return body, code
