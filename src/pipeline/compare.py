"""``pipeline compare``: one request through two configurations, and where they part, located
to a step and a layer (docs/tracing.md, "Why do two configurations disagree?").

Owns :func:`compare` (two built pipelines), :func:`compare_models` (the same from two sets of
``build()`` arguments, e.g. two backends, two dtypes, a quantized file and its float
checkpoint, two thread counts, batch invariance on and off) and the report
(:class:`CompareReport`).

How it works, in three passes:

1. **The answers.** The request runs through each pipeline as any request does, recorded at
   ``full``; :func:`~pipeline.trace.diff.diff` of the two traces gives the first step whose
   committed tokens differ (both tokens, their text and probabilities) and the earliest
   internal difference.
2. **The model, in lockstep.** Each backend is fed the same tokens (the prompt, then run A's
   committed tokens up to and including the first step where the runs part), on its engine
   thread, one step on both sides before the next (so memory holds one step, however long
   the answers), and every step's logits ``z_t`` are computed from the same inputs on both
   sides. Each step reports the largest logit difference against what the dtypes explain. A
   side may run ``company`` other sequences in the same forwards (batched against alone).
3. **The layers.** With taps (:class:`~pipeline.contracts.model.LayerTaps`) each step's
   hidden states are kept (a prompt's last :data:`TAP_ROWS` positions) and compared name by
   name; the report names the first tap, in forward order, whose difference exceeds what the
   dtypes explain, at the first step where any does, with the whole layer-by-layer picture of
   that step.

What the dtypes explain is :mod:`pipeline.tolerance`'s: a difference within it is reported
as "within noise"; beyond it, "not explained".

Example::

    report = compare_models("model-folder", "Why is the sky blue?",
                            a={"backend": "torch"}, b={"backend": "transformers"})
    print(report.render())
    report.first_layer         # None, or the first LayerDiff beyond tolerance
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pipeline.contracts.model import Backend, ModelCall, has_taps
from pipeline.contracts.request import GenerationConfig, Recording
from pipeline.engine.paging import Paging
from pipeline.errors import InvalidValueError
from pipeline.pipe import seed_for
from pipeline.tolerance import TOLERANCE, depth_of, explained, pair_unit
from pipeline.trace.diff import DiffReport, diff
from pipeline.trace.load import load

if TYPE_CHECKING:
    from pipeline.pipe import Pipeline

TAP_ROWS = 64
"""The prompt positions whose hidden states are kept and compared (its last ones): the
memory a step's taps hold stays bounded, whatever the prompt's length."""

DEFAULT_MAX_TOKENS = 16

MAX_COMPANY = 64
"""The most other sequences a side may run beside the compared one."""


@attrs.frozen
class StepDiff:
    """The logits ``z_t`` of both sides at step t, computed from the same inputs."""

    step: int
    max_diff: float
    explained: float
    argmax: tuple[int, int]

    @property
    def within(self) -> bool:
        """Whether the difference is within what the dtypes explain."""
        return self.max_diff <= self.explained


@attrs.frozen
class LayerDiff:
    """One tap's hidden states at one step: the largest difference, the magnitude (max |x|
    on side A) and what the dtypes explain."""

    name: str
    max_diff: float
    magnitude: float
    explained: float

    @property
    def within(self) -> bool:
        """Whether the difference is within what the dtypes explain."""
        return self.max_diff <= self.explained

    def render(self) -> str:
        """``layers.0.attention: differs by 3.0e-03 (rounding explains 4.0e-03): within
        noise``."""
        if self.max_diff == 0:
            return f"{self.name}: identical"
        verdict = "within noise" if self.within else "not explained"
        return (f"{self.name}: differs by {self.max_diff:.2e} (rounding explains "
                f"{self.explained:.2e}; max |x| {self.magnitude:.3g}): {verdict}")


@attrs.frozen
class Flip:
    """Where the committed tokens part: each side's preference between the two tokens
    (its logit for its own token minus its logit for the other's)."""

    step: int
    tokens: tuple[int, int]
    margins: tuple[float, float]
    explained: float

    @property
    def near_tie(self) -> bool:
        """Whether both margins are within what the dtypes explain: rounding can flip it."""
        return max(abs(m) for m in self.margins) <= self.explained


@attrs.frozen
class CompareReport:
    """What :func:`compare` found. ``steps``: each lockstep step's logit difference;
    ``layers``: every tap at ``layer_step`` (the first step where a tap exceeds tolerance,
    else the first divergent step, else the last); ``first_layer``: the first tap beyond
    tolerance there (None: none is)."""

    labels: tuple[str, str]
    dtypes: tuple[str, str]
    unit: float
    answers: DiffReport
    steps: tuple[StepDiff, ...]
    flip: Flip | None = None
    layer_step: int | None = None
    layers: tuple[LayerDiff, ...] = ()
    first_layer: LayerDiff | None = None
    prompt_tokens: tuple[int, int] = (0, 0)
    tapped: bool = False

    @property
    def first_step_beyond(self) -> StepDiff | None:
        """The first step whose logits differ beyond what the dtypes explain."""
        return next((s for s in self.steps if not s.within), None)

    def render(self) -> str:
        """The report in words, the answers first."""
        a, b = self.labels
        lines = [f"A: {a} ({self.dtypes[0]})", f"B: {b} ({self.dtypes[1]})",
                 f"tolerance: {TOLERANCE:g} x (u + u32 x sqrt(width)) x max|x| x sqrt(depth), "
                 f"u = {self.unit:.3g}",
                 self.answers.answers()]
        earliest = self.answers.earliest()
        if earliest is not None and self.answers.first_token is None:
            lines.append(earliest)
        if self.prompt_tokens[0] != self.prompt_tokens[1]:
            lines.append("the prompts tokenize differently: the model was not compared")
            return "\n".join(lines)
        if self.steps:
            worst = max(self.steps, key=lambda s: s.max_diff / s.explained)
            beyond = self.first_step_beyond
            lines.append(f"logits, {len(self.steps)} steps from the same inputs: largest "
                         f"difference {max(s.max_diff for s in self.steps):.2e}; "
                         + ("every step within noise" if beyond is None else
                            f"first beyond tolerance at step {beyond.step} "
                            f"({beyond.max_diff:.2e} against {beyond.explained:.2e})")
                         + f" (worst ratio at step {worst.step})")
        if self.flip is not None:
            f = self.flip
            lines.append(f"step {f.step}: A prefers {f.tokens[0]} over {f.tokens[1]} by "
                         f"{f.margins[0]:.3g}, B prefers {f.tokens[1]} by {f.margins[1]:.3g}: "
                         + ("a near tie that rounding explains" if f.near_tie else
                            "a margin rounding does not explain"))
        if self.tapped:
            if self.first_layer is None:
                lines.append("layers: every tap within noise at every step compared")
            else:
                lines.append(f"first layer beyond tolerance: {self.first_layer.name} at step "
                             f"{self.layer_step}")
            if self.layers:
                lines.append(f"layer by layer at step {self.layer_step}:")
                lines += [f"  {layer.render()}" for layer in self.layers]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping."""
        def layer(d: LayerDiff) -> dict[str, Any]:
            return {**attrs.asdict(d), "within": d.within}
        return {"labels": list(self.labels), "dtypes": list(self.dtypes), "unit": self.unit,
                "tolerance": TOLERANCE, "answers": self.answers.to_json(),
                "prompt_tokens": list(self.prompt_tokens),
                "steps": [{**attrs.asdict(s), "within": s.within} for s in self.steps],
                "flip": None if self.flip is None else {**attrs.asdict(self.flip),
                                                        "near_tie": self.flip.near_tie},
                "layer_step": self.layer_step, "layers": [layer(d) for d in self.layers],
                "first_layer": None if self.first_layer is None else layer(self.first_layer),
                "tapped": self.tapped}


def compare(a: Pipeline, b: Pipeline, prompt: Any, *, labels: tuple[str, str] = ("A", "B"),
            taps: bool = True, company: tuple[int, int] = (0, 0), b_prompt: Any = None,
            b_options: Mapping[str, Any] | None = None, allow_request_difference: bool = False,
            **options: Any) -> CompareReport:
    """Run ``prompt`` (with ``options``, :meth:`Pipeline.request`'s keywords; default
    ``temperature=0`` and ``max_tokens=16``) through pipelines ``a`` and ``b`` and report where
    they part (module docstring).

    Side B gets exactly side A's request (its settings resolved once, on A), unless
    ``b_prompt`` or ``b_options`` say otherwise; a request that then differs is refused,
    naming the difference, unless ``allow_request_difference``. ``taps`` compares the layers
    (both backends must have :class:`~pipeline.contracts.model.LayerTaps`; False skips
    them). ``company`` runs that many other sequences beside each side's in every forward
    of the lockstep pass (batched against alone)."""
    _check_company(company)
    options = {"temperature": 0, "max_tokens": DEFAULT_MAX_TOKENS, **options}
    options.pop("recording", None)
    request_a = a.request(prompt, recording=Recording.FULL, **options)
    if request_a.generation_config.seed is None:  # one seed for both, not one per request id
        request_a = attrs.evolve(request_a, generation_config=attrs.evolve(
            request_a.generation_config, seed=seed_for(request_a)))
    config_b: GenerationConfig = request_a.generation_config
    if b_options:
        config_b = b.request(prompt, config_b, **b_options).generation_config
    own = {k: v for k, v in options.items() if k not in _config_fields()}
    request_b = b.request(prompt if b_prompt is None else b_prompt, config_b,
                          recording=Recording.FULL, **own)
    if not allow_request_difference:
        _refuse_difference(request_a, request_b)
    backends = [_backend(p, side, taps) for p, side in ((a, "A"), (b, "B"))]
    prepared = [a.prepare(request_a), b.prepare(request_b)]
    ids = [tuple(p.tokens.input_ids) for p in prepared]
    runs = [a.generate(prepared[0]), b.generate(prepared[1])]
    answers = diff(load(runs[0]), load(runs[1]))
    dtypes = (_dtype(a), _dtype(b))
    unit = pair_unit(*dtypes)
    if ids[0] != ids[1]:
        return CompareReport(labels, dtypes, unit, answers, (),
                             prompt_tokens=(len(ids[0]), len(ids[1])))
    tokens = list(runs[0].token_ids)
    flip_step = answers.first_token.step if answers.first_token is not None else None
    walked = tokens[:flip_step - 1] if flip_step is not None else tokens[:-1]
    depth, width = _shape(a)
    sides = [_Side(p, backend, list(ids[0]), n, taps)
             for p, backend, n in zip((a, b), backends, company)]
    steps: list[StepDiff] = []
    flip = None
    shown: dict[str, tuple[int, list[LayerDiff]]] = {}  # first beyond, flip, last
    try:
        for t in range(1, len(walked) + 2):
            fed = [one.feed(None if t == 1 else walked[t - 2]) for one in sides]
            (za, ta), (zb, tb) = fed
            steps.append(StepDiff(t, float((za - zb).abs().max()),
                                  explained(unit, float(za.abs().max()), depth, width),
                                  (int(za.argmax()), int(zb.argmax()))))
            ft = answers.first_token
            if t == flip_step and ft is not None and ft.a is not None and ft.b is not None:
                x, y = ft.a.token_id, ft.b.token_id  # not a run that ended there
                flip = Flip(t, (x, y), (float(za[x] - za[y]), float(zb[y] - zb[x])),
                            steps[-1].explained)
            if taps:
                row = _layer_row(ta, tb, unit)
                if "beyond" not in shown and any(not d.within for d in row):
                    shown["beyond"] = (t, row)
                if t == flip_step:
                    shown["flip"] = (t, row)
                shown["last"] = (t, row)
    finally:
        for one in sides:
            one.close()
    report = CompareReport(labels, dtypes, unit, answers, tuple(steps), flip,
                           prompt_tokens=(len(ids[0]), len(ids[1])), tapped=taps)
    if not shown:
        return report
    layer_step, layers = shown.get("beyond") or shown.get("flip") or shown["last"]
    first = next((d for d in layers if not d.within), None)
    return attrs.evolve(report, layer_step=layer_step, layers=tuple(layers), first_layer=first)


def _check_company(company: Sequence[int]) -> None:
    for n, side in zip(company, "AB"):
        if not 0 <= n < MAX_COMPANY:
            raise InvalidValueError("company", n, f"side {side}: 0..{MAX_COMPANY - 1} other "
                                    "sequences")


def _config_fields() -> frozenset[str]:
    return frozenset(f.name for f in attrs.fields(GenerationConfig))


def _layer_row(ta: Mapping[str, torch.Tensor], tb: Mapping[str, torch.Tensor], unit: float
               ) -> list[LayerDiff]:
    """Every tap's difference at one step, in forward order."""
    row = []
    for name, xa in ta.items():
        magnitude = float(xa.abs().max())
        row.append(LayerDiff(name, float((xa - tb[name]).abs().max()), magnitude,
                             explained(unit, magnitude, depth_of(name), xa.shape[-1])))
    return row


def _refuse_difference(a: Any, b: Any) -> None:
    """An :class:`InvalidValueError` naming what differs between the two requests."""
    def content(r: Any) -> Any:
        return (r.messages, r.prompt, r.prompt_ids, r.tool_catalog, dict(r.template_kwargs))
    if content(a) != content(b):
        raise InvalidValueError("b_prompt", "(differs)", "the two requests' text differs: "
                                "compare runs one request through two configurations "
                                "(allow_request_difference=True compares them anyway)")
    ca, cb = attrs.asdict(a.generation_config), attrs.asdict(b.generation_config)
    changed = [f"{k}: {ca[k]!r} vs {cb[k]!r}" for k in ca if ca[k] != cb[k]]
    if changed:
        raise InvalidValueError("b_options", "; ".join(changed), "the two requests' "
                                "settings differ (allow_request_difference=True compares "
                                "them anyway)")


def _backend(pipe: Pipeline, side: str, taps: bool) -> Backend:
    engine = pipe.engine
    if engine is None:
        raise InvalidValueError("pipeline", side, "has no model backend to compare")
    backend = engine.backend
    if taps and not has_taps(backend):
        raise InvalidValueError("taps", True, f"side {side}'s backend "
                                f"({type(backend).__name__}) has no layer taps "
                                "(LayerTaps); compare without taps (taps=False, --no-taps)")
    return backend


def _shape(pipe: Pipeline) -> tuple[int, int]:
    """The model's layers and hidden size, from its config (a transformers model's) or spec
    (the torch backend's), whether or not taps are on; ``(1, 1)`` when it has neither."""
    engine = pipe.engine
    model = getattr(engine.backend, "model", None) if engine is not None else None
    config = getattr(model, "config", None) or getattr(model, "spec", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
    width = getattr(config, "hidden_size", None)
    return (layers if isinstance(layers, int) else 1), (width if isinstance(width, int) else 1)


def _dtype(pipe: Pipeline) -> str:
    info = pipe.model_info()
    return info.dtype if info is not None else "float32"


class _Side:
    """One side's backend fed in lockstep: each :meth:`feed` runs one forward on the
    engine's thread (:meth:`~pipeline.engine.api.EngineAPI.call`, between engine steps) and
    returns that step's logits ``[V]`` and, with taps, its hidden states (a prompt's last
    :data:`TAP_ROWS` positions), so one step is held in memory at a time. ``company`` other
    sequences share every forward. A paged backend's blocks come from the engine's own block
    manager, as a request's do; :meth:`close` gives slots and blocks back."""

    def __init__(self, pipe: Pipeline, backend: Backend, prompt: list[int], company: int,
                 taps: bool) -> None:
        engine = pipe.engine
        assert engine is not None
        inner = getattr(engine, "engine", None)
        if inner is None:
            raise InvalidValueError("pipeline", "(engine process)", "compare drives the "
                                    "backend on its engine's thread: build the pipeline with "
                                    "the engine in this process")
        memory = inner.memory
        self.engine, self.backend, self.taps = engine, backend, taps
        self.blocks = memory.blocks if isinstance(memory, Paging) else None
        span = max(min(backend.vocab_size - 3, 200), 1)  # ordinary ids of any vocabulary
        self.seqs = [list(prompt)] + [[(7 + 13 * i + j) % span + 3 for j in range(5 + i)]
                                      for i in range(company)]
        self.slots: list[int] = []
        self.nexts: list[int] = []

    def feed(self, token: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The prompts (``token`` None, the first call), else ``token`` for the compared
        sequence and each other one's own greedy choice."""
        result: tuple[torch.Tensor, dict[str, torch.Tensor]] = self.engine.call(
            lambda: self._forward(token)).result()
        return result

    def _forward(self, token: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        kept: dict[str, torch.Tensor] = {}

        def receive(call: int, name: str, hidden: torch.Tensor) -> None:
            if call == 0:
                kept[name] = hidden[-TAP_ROWS:].float().cpu().clone()

        first = token is None
        if first:
            self.slots = [self.backend.allocate() for _ in self.seqs]
        news: list[int | None] = [None] * len(self.seqs) if first else [token, *self.nexts[1:]]
        calls = []
        for slot, seq, new in zip(self.slots, self.seqs, news):
            start = 0 if new is None else len(seq)
            ids = tuple(seq) if new is None else (new,)
            table = None
            if self.blocks is not None:
                key = ("compare", slot)
                table = (self.blocks.allocate(key, len(ids)) if new is None
                         else self.blocks.grow(key, start + 1))
            calls.append(ModelCall(slot, ids, start, (len(ids) - 1,), blocks=table,
                                   prompt=new is None))
            if new is not None:
                seq.append(new)
        if self.taps:
            self.backend.set_tap(receive)  # type: ignore[attr-defined]
        try:
            out = self.backend.forward(calls)
        finally:
            if self.taps:
                self.backend.set_tap(None)  # type: ignore[attr-defined]
        self.nexts = [int(r.argmax()) for r in out]
        return out[0].float().cpu(), kept

    def close(self) -> None:
        """Release the slots and blocks (on the engine's thread)."""
        def release() -> None:
            for slot in self.slots:
                self.backend.release(slot)
                if self.blocks is not None and ("compare", slot) in self.blocks:
                    self.blocks.free(("compare", slot))
            self.slots = []
        self.engine.call(release).result()


def compare_models(model: Any, prompt: Any, *, a: Mapping[str, Any] | None = None,
                   b: Mapping[str, Any] | None = None, **options: Any) -> CompareReport:
    """:func:`compare` of two pipelines built from ``model`` with ``build()`` arguments ``a``
    and ``b`` (``{"backend": "transformers"}``, ``{"options": {"dtype": "bfloat16"}}``, a
    ``"model"`` of its own for a quantized file against its float checkpoint); each side's
    ``company`` (other sequences in its forwards) is taken out of its mapping. Both are
    closed afterwards."""
    from pipeline.builder import build

    sides = [dict(a or {}), dict(b or {})]
    company = tuple(int(s.pop("company", 0)) for s in sides)
    _check_company(company)
    labels = tuple(_label(s) for s in sides)
    built: list[Pipeline] = []
    try:
        for side in sides:
            built.append(build(side.pop("model", model), **side))
        return compare(built[0], built[1], prompt, labels=(labels[0], labels[1]),
                       company=(company[0], company[1]), **options)
    finally:
        for pipe in built:
            pipe.close()


def _label(side: Mapping[str, Any]) -> str:
    """A side's settings in a few words: ``backend=transformers dtype=bfloat16``."""
    flat = {k: v for k, v in side.items() if k != "options"}
    flat.update(side.get("options") or {})
    flat = {k: v for k, v in flat.items() if isinstance(v, (str, int, float, bool))}
    return " ".join(f"{k}={v}" for k, v in flat.items()) or "defaults"
