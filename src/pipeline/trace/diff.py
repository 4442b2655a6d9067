"""``pipeline trace diff``: the first divergence between two runs (docs/design.md §9).

Owns :func:`diff` and :class:`DiffReport` (a :class:`Divergence` names the product). The walk
follows the data products in causal order: the request's content → rendered bytes → token
ids → positions, then for each
step t: cache after prefill, an iterative strategy's passes over the block starting at t
(each pass's time, state and logits, ``step.iteration``), raw logits z_t (model level) →
processor order → processed
distribution → RNG draw → selected token (selection level) → the run's ending at t (stop:
selection; cancellation, deadline, failure: system) → emitted bytes (system) → cache after
decode t (model); after the steps: client display and external effects (tool events).
Within a step the ending and the emitted bytes come before the cache after decode because
the token that ends a run is never decoded, and the ending before the bytes because a stop
or a cancel is what trims or closes that step's stream.

For an iterative strategy (masked diffusion, docs/design.md §10) the walk first goes through its
iterations in order, after the input: for iteration k, the block fed to the denoiser, the
logits of that pass (model level), then what the pass committed (positions and the tokens
there), so the report names the first divergent iteration. Different commits are blamed on
the sampler's settings first (``step.configured`` differs: the detail names the settings),
then on the seeds (``rng``, when the noise seeds differ and a run draws), else on the pass
itself; the sampler's settings are also declared differences. The per-token walk follows.

Digest-level traces locate a divergence (digests differ); ``full`` traces explain it (texts,
ids, top-k, draws) and let logits be compared within ``atol`` on their top-k; ``taps``
traces add the first step and the first layer whose hidden states differ
(:mod:`pipeline.trace.layers`). Differences in
the execution instance (artifact digests, generation config, environment) are listed as
*declared* differences: they are causes, judged by the products they change.

The report leads with what a reader compares first, the answers: the first step whose
committed tokens differ (:func:`pipeline.trace.tokens.first_token`: both tokens, their text
and probabilities), then the first divergence of any level, worded as the *earliest internal
difference* and placed against that step ("it changed no token until step 49"), so an early
internal difference (a different seed's draw at step 1) never reads as a contradiction of a
later different token.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from pipeline.events import Event, digest_ids
from pipeline.trace.layers import LayerReport, first_layer
from pipeline.trace.load import Trace, TraceSource, fed, load
from pipeline.trace.products import (
    LEVELS, Divergence, cache_after, ending, external_effects, logits_equal, processed_at,
    raw_logits_at, shown,
)
from pipeline.trace.tokens import FirstToken, TokenText, first_token
from pipeline.contracts.request import GenerationConfig

INSTANCE_SKIP = frozenset({"request_id", "traceparent", "traceparent_ignored"})

READABLE = {"rng": "the random draw", "prefill logits": "the model's scores for the first token",
            "raw logits": "the model's scores", "processor order":
            "the order of the sampling settings", "processed distribution":
            "the distribution after the sampling settings", "selected token":
            "the selected token", "emitted bytes": "the streamed text", "stop":
            "where a run stopped", "finish": "how the runs ended"}
"""Products named in words a reader knows (the product's own name follows in parentheses)."""


@attrs.frozen
class DiffReport:
    """What :func:`diff` found about runs A and B."""

    divergence: Divergence | None
    shared_level: str
    atol: float
    declared: tuple[tuple[str, Any, Any], ...]
    steps_compared: int
    batch_invariant: tuple[Any, Any] = (None, None)
    """What each run's trace declared about batch invariance (``request.normalized``'s
    ``batch_invariant``: True, False, or None when the backend said nothing)."""
    first_token: FirstToken | None = None
    """The first step whose committed tokens differ, with both tokens (None: the same
    tokens throughout)."""
    committed: tuple[int, int] = (0, 0)
    """How many tokens each run committed."""
    layers: LayerReport | None = None
    """With layer taps in both traces: the first step whose layers differ, and every
    layer there (:mod:`pipeline.trace.layers`)."""

    def caveat(self) -> str | None:
        """Why a model-level divergence may come from the batches rather than the inputs: a
        run that did not declare its logits independent of its batch."""
        d = self.divergence
        if d is None or d.level != "model":
            return None
        runs = [name for name, v in zip("AB", self.batch_invariant) if v is not True]
        if not runs:
            return None
        return (f"run {' and '.join(runs)} did not declare batch invariance: its logits may "
                "depend on the requests that shared its batches (BackendOptions.batch_invariant)")

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping (for CI and other tools)."""
        d = self.divergence
        ft = self.first_token
        return {"divergence": None if d is None else attrs.asdict(d),
                "shared_level": self.shared_level, "atol": self.atol,
                "declared": [{"field": k, "a": a, "b": b} for k, a, b in self.declared],
                "steps_compared": self.steps_compared,
                "batch_invariant": list(self.batch_invariant), "caveat": self.caveat(),
                "first_token": None if ft is None else ft.to_json(),
                "committed_tokens": list(self.committed),
                "layers": None if self.layers is None else self.layers.to_json()}

    def answers(self) -> str:
        """One line on the answers themselves: how long they agree and where their tokens
        first differ (with both tokens), or that they agree on every token."""
        if self.first_token is not None:
            return self.first_token.render()
        n = self.committed[0]
        return f"the answers agree on all {n} token{'' if n == 1 else 's'}"

    def earliest(self) -> str | None:
        """The first divergence of any level as a line placed against the first different
        token: ``earliest internal difference: the random draw (rng) at step 1 (selection
        level) — it changed no token until step 49``."""
        d = self.divergence
        if d is None:
            return None
        words = READABLE.get(d.product)
        name = f"{words} ({d.product})" if words else d.product
        where = f" at step {d.step}" if d.step is not None else ""
        ft = self.first_token
        if d.step is None:
            then = " — before the first token" if d.level == "input" else \
                " — after the last token"
        elif ft is None:
            then = " — it changed no token"
        elif d.step < ft.step:
            then = f" — it changed no token until step {ft.step}"
        else:
            then = " — at that same step" if d.step == ft.step else ""
        return f"earliest internal difference: {name}{where} ({d.level} level){then}"

    def render(self) -> str:
        """A readable report: the declared differences, the answers (:meth:`answers`), the
        earliest internal difference (:meth:`earliest`) with both sides, the shared level."""
        lines = []
        for key, a, b in self.declared:
            lines.append(f"declared difference: {key}: {shown(a)} vs {shown(b)}")
        d = self.divergence
        if d is None and self.first_token is None:
            lines.append(f"no divergence in {self.steps_compared} steps: {self.answers()}")
        else:
            lines.append(self.answers())
        if self.first_token is not None and self.first_token.missing:
            lines.append(f"  ({self.first_token.missing})")
        if d is not None:
            lines.append(str(self.earliest()))
            lines.append(f"  A: {shown(d.a)}")
            lines.append(f"  B: {shown(d.b)}")
            if d.detail:
                lines.append(f"  {d.detail}")
            caveat = self.caveat()
            if caveat is not None:
                lines.append(f"  note: {caveat}")
        if self.layers is not None:
            lines += self.layers.lines()
        tol = f" (raw logits compared with atol={self.atol:g})" if self.shared_level != "none" \
            else ""
        lines.append(f"shared reproducibility level: {self.shared_level}{tol}")
        return "\n".join(lines)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def declared(a: Trace, b: Trace) -> tuple[tuple[str, Any, Any], ...]:
    """Execution-instance fields that differ (flattened keys, sorted)."""
    fa = {k: v for k, v in _flatten(a.instance).items() if k.split(".")[0] not in INSTANCE_SKIP}
    fb = {k: v for k, v in _flatten(b.instance).items() if k.split(".")[0] not in INSTANCE_SKIP}
    if fa.get("generation_config.seed") is None and fb.get("generation_config.seed") is None:
        fa.pop("seed", None), fb.pop("seed", None)  # derived from the request ids: not a cause
    for key, value in _flatten(a.payload("step.configured"), "strategy.").items():
        fa[key] = value
    for key, value in _flatten(b.payload("step.configured"), "strategy.").items():
        fb[key] = value
    fa.pop("strategy.step", None), fb.pop("strategy.step", None)
    return tuple((k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
                 if fa.get(k) != fb.get(k))


def _same(product: str, level: str, step: int | None, a: Any, b: Any, detail: str = ""
          ) -> Divergence | None:
    return None if a == b else Divergence(product, level, step, a, b, detail)


def _input(a: Trace, b: Trace) -> Iterator[Divergence | None]:
    keys = ("messages_digest", "prompt_digest", "tools_digest", "template_kwargs")
    yield _same("request", "input", None, {k: a.instance.get(k) for k in keys},
                {k: b.instance.get(k) for k in keys}, "the request's content differs")
    ra, rb = a.payload("context.rendered"), b.payload("context.rendered")
    yield _same("rendered bytes", "input", None, ra.get("rendered_digest"),
                rb.get("rendered_digest"), _first_char(ra.get("text"), rb.get("text")))
    ta, tb = a.payload("input.tokenized"), b.payload("input.tokenized")
    yield _same("token ids", "input", None, ta.get("ids_digest"), tb.get("ids_digest"),
                _first_item(ta.get("input_ids"), tb.get("input_ids"), ta, tb))
    yield _same("positions", "input", None, ta.get("positions_digest"),
                tb.get("positions_digest"))


def _first_char(x: Any, y: Any) -> str:
    if not isinstance(x, str) or not isinstance(y, str):
        return ""
    i = next((n for n, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return f"first differing character at {i}: {x[i:i + 30]!r} vs {y[i:i + 30]!r}"


def _first_item(x: Any, y: Any, ta: Mapping[str, Any], tb: Mapping[str, Any]) -> str:
    lengths = f"m = {ta.get('tokens')} vs {tb.get('tokens')}"
    if not isinstance(x, list) or not isinstance(y, list):
        return lengths
    i = next((n for n, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return f"{lengths}; first differing position {i}: {x[i:i + 5]} vs {y[i:i + 5]}"


def _step(a: Trace, b: Trace, t: int, atol: float) -> Iterator[Divergence | None]:
    """The products of step t in walk order."""
    sa, sb = a.by_step("token.selected").get(t), b.by_step("token.selected").get(t)
    if sa is None or sb is None:
        yield ending(a, b, t)
        return
    if t == 1:
        pa, pb = a.payload("prefill.completed"), b.payload("prefill.completed")
        yield _same("cache after prefill", "model", t, pa.get("cache_len"), pb.get("cache_len"))
    yield from _iterations(a, b, t, atol)
    raw_a, raw_b = raw_logits_at(a, t), raw_logits_at(b, t)
    raw_same, detail = logits_equal(raw_a, raw_b, atol)
    name = "prefill logits" if t == 1 else "raw logits"
    yield None if raw_same else Divergence(name, "model", t, raw_a, raw_b, detail)
    if t == 1 or (_full(a) and _full(b)):
        yield _same("processor order", "selection", t, order_at(a, t), order_at(b, t))
    proc_a, proc_b = processed_at(sa), processed_at(sb)
    proc_same, detail = logits_equal(proc_a, proc_b, atol if raw_same else 0.0)
    yield None if proc_same else Divergence("processed distribution", "selection", t, proc_a,
                                            proc_b, detail)
    yield _rng(a, b, sa.payload, sb.payload, t)
    yield _same("selected token", "selection", t, sa.payload.get("token_id"),
                sb.payload.get("token_id"))
    yield ending(a, b, t, both_selected=True)
    da_, db_ = _deltas(a, t), _deltas(b, t)
    yield _same("emitted bytes", "system", t, da_, db_,
                f"text {_texts(a, t)!r} vs {_texts(b, t)!r}" if da_ != db_ else "")
    yield _same("cache after decode", "model", t, cache_after(a, t), cache_after(b, t))


def iterations_at(trace: Trace, t: int) -> list[tuple[Mapping[str, Any], list[Any]]]:
    """The ``step.iteration`` events of the block whose first token is t (an iterative
    strategy's denoising passes), each with the logits records of the call it describes
    (the ``decode.completed`` that follows it)."""
    out: list[tuple[Mapping[str, Any], list[Any]]] = []
    pending: Mapping[str, Any] | None = None
    for event in trace.events:
        if event.event_type == "step.iteration" and event.payload.get("step") == t:
            pending = event.payload
        elif event.event_type == "decode.completed" and pending is not None:
            block = event.payload.get("block_logits")
            out.append((pending, block if isinstance(block, list)
                        else [event.payload.get("logits")]))
            pending = None
    return out


def _iterations(a: Trace, b: Trace, t: int, atol: float) -> Iterator[Divergence | None]:
    """An iterative strategy's passes over the block starting at token t, in order: each
    pass's schedule (rule, block length, time), its inputs (the self-condition estimate, the
    state fed) and its logits; the first that differs names the iteration."""
    ia, ib = iterations_at(a, t), iterations_at(b, t)
    if not ia and not ib:
        return
    cause = _cause(a, b)
    for k in range(max(len(ia), len(ib))):
        if k >= len(ia) or k >= len(ib):
            yield Divergence("iterations", "selection", t, len(ia), len(ib),
                             f"the block at token {t} took {len(ia)} vs {len(ib)} passes")
            return
        (pa, la), (pb, lb) = ia[k], ib[k]
        where = (f"iteration {k + 1} of the block at token {t} "
                 f"({pa.get('iterations')} vs {pb.get('iterations')} per block)")
        for key, product in (("rule", "iteration rule"), ("length", "block length"),
                             ("time", "iteration time")):
            yield _same(product, "selection", t, pa.get(key), pb.get(key), where)
        for key, product in (("x0_digest", "self-condition"), ("state_digest",
                                                                "iteration state")):
            yield _same(product, "selection", t, pa.get(key), pb.get(key), where + cause)
        for row, (ra, rb) in enumerate(zip(la, lb)):
            same, detail = logits_equal(ra, rb, atol)
            if not same:
                yield Divergence("iteration logits", "model", t, ra, rb,
                                 f"{where}, position {row}: {detail}")
                return


def _full(trace: Trace) -> bool:
    return trace.holds_content


def order_at(trace: Trace, t: int) -> list[str] | None:
    """The processors applied at step t: step 1's order, updated by each recorded change
    (changes are recorded at ``full`` only)."""
    order = trace.payload("selection.configured").get("processors")
    for step, event in sorted(trace.by_step("token.selected").items()):
        if step > t:
            break
        order = event.payload.get("processors", order)
    return order


def _rng(a: Trace, b: Trace, pa: Mapping[str, Any], pb: Mapping[str, Any], t: int
         ) -> Divergence | None:
    """Seeds (the counter RNG's stream) when either run samples; draws where recorded."""
    sampled = [_samples(tr) for tr in (a, b)]
    if not any(sampled):
        return None
    seeds = (a.payload("selection.configured").get("seed"),
             b.payload("selection.configured").get("seed"))
    if seeds[0] != seeds[1]:
        return Divergence("rng", "selection", t, f"seed {seeds[0]}", f"seed {seeds[1]}",
                          "different random streams: every draw differs")
    if "draw" in pa and "draw" in pb:
        return _same("rng", "selection", t, pa["draw"], pb["draw"], "uniform draws differ")
    return None


def _step_deltas(trace: Trace, t: int) -> list[Event]:
    end = trace.finished.event_id if trace.finished is not None else None
    return [d for d in trace.of("stream.delta")
            if d.payload.get("step") == t and (end is None or d.event_id < end)]


def _deltas(trace: Trace, t: int) -> list[tuple[Any, ...]]:
    """Step t's deltas as (digest, bytes, final): comparable across recording levels."""
    return [(d.payload.get("digest"), d.payload.get("bytes"), d.payload.get("final"))
            for d in _step_deltas(trace, t)]


def _texts(trace: Trace, t: int) -> str | None:
    """Step t's streamed text, when recorded (``full``)."""
    deltas = _step_deltas(trace, t)
    if not all("text" in d.payload for d in deltas):
        return None
    return "".join(d.payload["text"] for d in deltas)


def _after(a: Trace, b: Trace) -> Iterator[Divergence | None]:
    fa, fb = a.finished, b.finished
    ra = fa.payload.get("reason") if fa else None
    rb = fb.payload.get("reason") if fb else None
    if ra != rb:
        level = "system" if {ra, rb} & {"cancelled", "deadline", "error", None} else "selection"
        yield Divergence("finish", level, None, ra, rb, "the runs ended differently")
    yield _same("client display", "system", None, _display(a), _display(b),
                "the concatenated streamed text differs")
    yield _same("external effect", "system", None, external_effects(a), external_effects(b))


def _display(trace: Trace) -> Any:
    """What the client shows: the digest of the whole streamed text (per-delta digests for
    traces that predate ``text_digest``)."""
    end = trace.payload("generation.finished")
    if "text_digest" in end:
        return end["text_digest"]
    return [d.payload.get("digest") for d in trace.of("stream.delta")]


def passes(trace: Trace) -> list[tuple[Event, Event]]:
    """An iterative run's iterations: each ``step.denoised`` with the model call it came
    from (the latest non-writing ``decode.completed`` before it; a ``reused`` pass ran on
    that call's logits too)."""
    out, call = [], None
    for event in trace.events:
        if event.event_type == "decode.completed" and event.payload.get("write") is False:
            call = event
        elif event.event_type == "step.denoised" and call is not None:
            out.append((call, event))
    return out


def _samples(trace: Trace) -> bool:
    """Whether the run's temperature is above 0 (the config's default when unrecorded)."""
    config = trace.instance.get("generation_config") or {}
    return float(config.get("temperature", GenerationConfig().temperature)) > 0


def _draws(trace: Trace) -> bool:
    """Whether an iterative run consumes random numbers (sampling, random remasking, DFM)."""
    configured = trace.payload("step.configured")
    if "noise" in configured:  # declared by the strategy
        return bool(configured["noise"] != "none")
    return _samples(trace) or configured.get("remasking") == "random" or \
        configured.get("sampler") == "dfm"


def noise_seed(trace: Trace) -> Any:
    """The seed an iterative run drew from: the one ``step.configured`` declares
    (``noise_seed``: a greedy request without a seed draws from a fixed one), else the
    request's (``selection.configured``)."""
    configured = trace.payload("step.configured")
    if "noise_seed" in configured:
        return configured["noise_seed"]
    return trace.payload("selection.configured").get("seed")


SEED_KEYS = frozenset({"step", "noise", "noise_seed"})
"""``step.configured`` keys that describe the run's randomness, not the sampler's settings."""


def settings_changed(a: Trace, b: Trace) -> str:
    """The sampler's settings that differ between the runs (``step.configured``, less
    :data:`SEED_KEYS`), as ``"eta 0.0 vs 0.5; steps 4 vs 8"`` ("" when none does)."""
    ca, cb = a.payload("step.configured"), b.payload("step.configured")
    keys = sorted((set(ca) | set(cb)) - SEED_KEYS)
    return "; ".join(f"{k} {ca.get(k)!r} vs {cb.get(k)!r}" for k in keys
                     if ca.get(k) != cb.get(k))


def _cause(a: Trace, b: Trace) -> str:
    """What can make an iteration's state differ, as a clause for the detail: the settings
    first, then the noise seeds ("" when neither differs)."""
    changed, seeds = settings_changed(a, b), (noise_seed(a), noise_seed(b))
    if changed:
        return f"; the strategy's settings differ ({changed})"
    if seeds[0] != seeds[1]:
        return f"; the noise seeds differ ({seeds[0]} vs {seeds[1]})"
    return ""


def _commits(payload: Mapping[str, Any]) -> tuple[Any, Any]:
    """What a pass committed: its positions and the digest of their tokens (the digest is
    computed from the ids a ``full`` trace recorded, so levels compare)."""
    ids = payload.get("ids")
    return payload.get("positions"), (digest_ids(ids) if isinstance(ids, list)
                                      else payload.get("ids_digest"))


def committed_tokens(trace: Trace, payload: Mapping[str, Any]) -> str:
    """What a pass committed, readable: ``[2, 5] = [104, 111]`` (positions = token ids).
    The ids are the pass's own at ``full``; otherwise the tokens its block committed there
    (``token.selected`` at the block's step + position: a pass's commit is final, bar a
    forced token), with ``?`` where none was selected (the run stopped before it)."""
    positions = payload.get("positions")
    ids = payload.get("ids")
    if not isinstance(ids, list) and isinstance(positions, list):
        selected, step = trace.by_step("token.selected"), payload.get("step")
        found = [selected.get(step + j) if isinstance(step, int) and isinstance(j, int)
                 else None for j in positions]
        ids = [e.payload.get("token_id") if e is not None else "?" for e in found]
    return f"{positions} = {ids}"


def _denoised(a: Trace, b: Trace) -> Iterator[Divergence | None]:
    """Iteration by iteration: the block fed, the pass's logits, what it committed."""
    seeds = (noise_seed(a), noise_seed(b))
    random = seeds[0] != seeds[1] and (_draws(a) or _draws(b))
    changed = settings_changed(a, b)
    for k, ((ca, sa), (cb, sb)) in enumerate(zip(passes(a), passes(b)), 1):
        t = sa.payload.get("step")
        where = (f"iteration {k} (block {sa.payload.get('block')}, pass "
                 f"{sa.payload.get('block_step')})")
        yield _same("denoiser input", "selection", t, sa.payload.get("input_digest"),
                    sb.payload.get("input_digest"), f"{where}: the block fed to the model "
                    f"differs: {fed(ca)} vs {fed(cb)}")
        la = [r.get("digest") for r in ca.payload.get("block_logits", [])]
        lb = [r.get("digest") for r in cb.payload.get("block_logits", [])]
        yield _same("denoiser logits", "model", t, la, lb, f"{where}: the model's output "
                    "for the same block differs")
        ka, kb = _commits(sa.payload), _commits(sb.payload)
        if ka == kb:
            continue
        commits = (f"committed positions {committed_tokens(a, sa.payload)} vs "
                   f"{committed_tokens(b, sb.payload)}")
        if changed:
            yield Divergence("denoised commits", "selection", t, ka, kb,
                             f"{where}: {commits}; the sampler's settings differ ({changed})")
        elif random:
            yield Divergence("rng", "selection", t, f"seed {seeds[0]}", f"seed {seeds[1]}",
                             f"{where}: different random streams: {commits}")
        else:
            yield Divergence("denoised commits", "selection", t, ka, kb, f"{where}: {commits}")


def _walk(a: Trace, b: Trace, atol: float) -> tuple[Divergence | None, int]:
    for found in _input(a, b):
        if found is not None:
            return found, 0
    for found in _denoised(a, b):
        if found is not None:
            return found, found.step or 0
    steps = max(len(a.by_step("token.selected")), len(b.by_step("token.selected")))
    for t in range(1, steps + 1):
        for found in _step(a, b, t, atol):
            if found is not None:
                return found, t
    return next((d for d in _after(a, b) if d is not None), None), steps


def diff(a: TraceSource | Trace, b: TraceSource | Trace, *, atol: float = 0.0,
         token_text: TokenText | None = None, token_text_b: TokenText | None = None
         ) -> DiffReport:
    """Walk two traces' data products and report the first that differs, and the first step
    whose committed tokens differ.

    ``atol`` is the model-level tolerance: raw logits whose digests differ still count as
    equal when both traces recorded their top-k (``full``) with the same token ids and
    values within ``atol``. With the default 0 the comparison is bitwise (by digest).
    ``token_text`` labels token ids with text (run A's, and B's unless ``token_text_b``
    does; e.g. the tokenizer's); without one, a ``full`` trace's streamed text does where
    it can (:func:`pipeline.trace.tokens.token_texts`).

    Example::

        report = diff(run_a.trace, run_b.trace)
        report.divergence.product       # e.g. "rng"
        report.first_token.step         # e.g. 49: the first different committed token
        report.shared_level             # e.g. "model"
    """
    ta, tb = load(a), load(b)
    found, steps = _walk(ta, tb, atol)
    if found is None:
        shared = LEVELS[-1]
    else:
        shared = LEVELS[LEVELS.index(found.level) - 1]
    return DiffReport(found, shared, atol, declared(ta, tb), steps,
                      (ta.instance.get("batch_invariant"), tb.instance.get("batch_invariant")),
                      first_token(ta, tb, token_text, token_text_b),
                      (len(ta.by_step("token.selected")), len(tb.by_step("token.selected"))),
                      first_layer(ta, tb))
