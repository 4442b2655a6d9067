"""The rules behind ``pipeline trace check``: one function per invariant of docs/design.md §8.

Owns :data:`TITLES` and the rule functions. Each rule reads a :class:`Trace` (and, for
invariant 5, an optional detokenizer) and returns the problems it found as
``(event ids, why)`` pairs plus notes on what the trace did not let it observe. Rules are
independent: a corruption of one kind is reported by exactly the rule that forbids it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from pipeline.events import Event, digest_ids, digest_text
from pipeline.trace.load import Trace, fed

Detokenize = Callable[[Sequence[int]], str]

TITLES: Mapping[int, str] = {
    0: "the trace is well formed (required events, parents before children)",
    1: "input ids trace back to a definite template and tokenizer artifact",
    2: "the KV cache covers the same logical positions in every layer; keys and values agree",
    3: "at each step start the cache prefix equals the prefix the logits condition on",
    4: "processors run only in their declared order",
    5: "streamed bytes are a safe prefix of the detokenized selected tokens",
    6: "finished, cancelled and failed are terminal: no ordinary delta after them",
    7: "a tool candidate never executes before it is parsed, validated and authorized",
    8: "after a write crosses the commit boundary, cancelling is not a rollback",
}

REQUIRED = ("request.accepted", "request.normalized", "context.rendered", "input.tokenized",
            "generation.finished", "resources.released")
TERMINAL_STATE = {"cancelled": "cancelled", "error": "failed"}


@attrs.frozen
class Finding:
    """What one rule saw: problems (event ids, why) and notes on what it could not see."""

    problems: tuple[tuple[tuple[int, ...], str], ...] = ()
    notes: tuple[str, ...] = ()


def _ids(*events: Event | None) -> tuple[int, ...]:
    return tuple(e.event_id for e in events if e is not None)


def structure(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 0: the minimal timeline's bookends exist; parents precede their children."""
    problems: list[tuple[tuple[int, ...], str]] = []
    for name in REQUIRED:
        if trace.first(name) is None:
            problems.append(((), f"no {name} event"))
    if trace.events[0].event_type != "request.accepted":
        problems.append((_ids(trace.events[0]), "the trace does not open with request.accepted"))
    seen: set[int] = set()
    for event in trace.events:
        parent = event.parent_event_id
        if parent is not None and parent not in seen:
            problems.append((_ids(event), f"parent event {parent} is not an earlier event"))
        seen.add(event.event_id)
    return Finding(tuple(problems))


def provenance(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 1: ids ← rendered bytes ← template, and ids ← tokenizer, all by digest."""
    inst, rendered, tokenized = (trace.first("request.normalized"),
                                 trace.first("context.rendered"), trace.first("input.tokenized"))
    if inst is None or rendered is None or tokenized is None:
        return Finding(notes=("normalize, render or tokenize event missing",))
    r, t, i = rendered.payload, tokenized.payload, inst.payload
    problems: list[tuple[tuple[int, ...], str]] = []
    ids = _ids(inst, rendered, tokenized)
    if not (inst.event_id < rendered.event_id < tokenized.event_id):
        problems.append((ids, "normalize → render → tokenize are out of causal order"))
    if t.get("rendered_digest") != r.get("rendered_digest"):
        problems.append((_ids(rendered, tokenized), "the ids were tokenized from rendered bytes "
                         f"{t.get('rendered_digest')}, not the {r.get('rendered_digest')} rendered"))
    if not t.get("tokenizer_digest") or t.get("tokenizer_digest") != i.get("tokenizer_version"):
        problems.append((_ids(inst, tokenized), f"tokenizer {t.get('tokenizer_digest')} is not "
                         f"the accepted artifact {i.get('tokenizer_version')}"))
    raw = r.get("renderer") == "raw" and i.get("prompt_digest") is not None
    if not r.get("template_digest") or not (raw or r.get("template_digest") == i.get(
            "template_version")):
        problems.append((_ids(inst, rendered), f"template {r.get('template_digest')} is not the "
                         f"accepted artifact {i.get('template_version')}"))
    if "text" in r and digest_text(r["text"]) != r.get("rendered_digest"):
        problems.append((_ids(rendered), "the recorded text does not match its digest"))
    if "input_ids" in t and (digest_ids(t["input_ids"]) != t.get("ids_digest")
                             or len(t["input_ids"]) != t.get("tokens")):
        problems.append((_ids(tokenized), "the recorded input ids do not match their digest"))
    return Finding(tuple(problems))


def cache_layers(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 2: prefill chunks tile 0..m-1; every layer's K and V lengths equal the cache's."""
    problems: list[tuple[tuple[int, ...], str]] = []
    written, prompt_written = 0, None
    for event in trace.events:
        if event.event_type == "prefix.hit":      # the prefix cache supplied these positions
            written = event.payload.get("cached_tokens", 0)
            continue
        if event.event_type == "preempted":       # the cache is gone; it is recomputed
            written = 0
            continue
        if event.event_type not in ("prefill.chunk", "prefill.completed"):
            continue
        start, tokens = event.payload.get("start"), event.payload.get("tokens")
        if isinstance(start, int) and isinstance(tokens, int):
            if start != written:
                problems.append((_ids(event), f"chunk writes positions {start}..{start + tokens - 1}"
                                 f" but the cache covers 0..{written - 1}: positions would differ"))
            written = start + tokens
        if event.event_type == "prefill.completed" and prompt_written is None:
            prompt_written = written
    m = trace.payload("input.tokenized").get("tokens")
    done = trace.first("prefill.completed")
    if done is not None and "start" in done.payload and prompt_written != m:
        problems.append((_ids(done), f"the chunks cover {prompt_written} positions, the prompt "
                         f"has {m}"))
    layered = [e for e in trace.events if "layers" in e.payload]
    for event in layered:
        k, v = event.payload["layers"].get("k", []), event.payload["layers"].get("v", [])
        length = event.payload.get("cache_len")
        bad = [n for n, (kl, vl) in enumerate(zip(k, v)) if not kl == vl == length]
        if bad or len(k) != len(v):
            problems.append((_ids(event), f"layer lengths k={k} v={v} do not all equal the "
                             f"cache length {length} (layers {bad})"))
    notes = () if layered else ("the backend reports no per-layer lengths; "
                                "checked the logical positions only",)
    return Finding(tuple(problems), notes)


def step_order(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 3 (docs/design.md §4): cache m after prefill, m+t-1 at selection t; a call at
    step t starts at m+t-1 and feeding y_t plus k drafts makes it m+t+k; a rollback drops exactly
    the positions it names; a token is selected only from logits whose fed prefix equals
    the committed one (a draft before it must be the token committed there). A call that
    does not write (``"write": false``, an iterative strategy's pass over a block) must
    leave the cache as it was; it fed no committed tokens, so the draft rule skips it."""
    problems: list[tuple[tuple[int, ...], str]] = []
    m = trace.payload("input.tokenized").get("tokens")
    prefill = trace.first("prefill.completed")
    if prefill is not None and prefill.payload.get("cache_len") != m:
        problems.append((_ids(prefill), f"cache length {prefill.payload.get('cache_len')} right "
                         f"after prefill; the prompt has m={m} tokens"))
    if iterative(trace):
        return _block_step_order(trace, m or 0, problems)
    selected, decoded = trace.by_step("token.selected"), trace.by_step("decode.completed")
    sources = trace.sources()
    for t, event in sorted(selected.items()):
        source = sources.get(t)
        problems += _selection_order(t, event, None if source is None else source[0], m)
        if source is not None and source[0].event_type == "decode.completed":
            problems += _conditioned(t, event, source[0], selected)
    problems += _cache_walk(trace, m or 0, selected)
    steps = sorted(selected)
    if steps != list(range(1, len(steps) + 1)):
        problems.append(((), f"selected steps {steps} are not 1..{len(steps)}"))
    finished = trace.finished
    if finished is not None and finished.payload.get("reason") not in ("cancelled", "deadline",
                                                                          "error"):
        last = finished.payload.get("completion_tokens")
        if isinstance(last, int) and last in decoded:
            problems.append((_ids(decoded[last]), f"the stopping token (step {last}) was decoded"))
    return Finding(tuple(problems))


def iterative(trace: Trace) -> bool:
    """Whether an iterative strategy (masked or continuous diffusion, flow) ran: some model call read the cache
    without writing it, or attended within a block."""
    return any(e.payload.get("write") is False or e.payload.get("attention") == "block"
               for e in trace.of("decode.completed"))


def _block_step_order(trace: Trace, m: int, problems: list[tuple[tuple[int, ...], str]]
                      ) -> Finding:
    """Invariant 3 for iterative strategies (docs/design.md §10): denoising passes read the
    cache and write nothing, and run only when the cache holds the prompt and every committed token (no
    finished block recomputed, none missing); a writing call feeds exactly the last committed
    tokens the cache lacks, then (a strategy that writes a block before committing all of it)
    exactly the tokens committed right after it; a committed token comes from the pass
    just before it, whose input held it or a mask at its position; a pass that reused the
    previous pass's logits (``reused``, no model call) follows a pass over the same block
    that committed nothing, so those logits are still the model's answer to it."""
    mask = trace.payload("step.configured").get("mask_token_id")
    cache, tokens = m, []
    last_pass: Event | None = None
    denoised: Event | None = None
    ahead: list[Any] = []  # written before being committed: the next tokens must be these
    for event in trace.events:
        p = event.payload
        if event.event_type == "step.denoised":
            problems += _reuse(event, denoised)
            denoised = event
        elif event.event_type == "token.selected":
            tokens.append(p.get("token_id"))
            problems += _from_pass(event, len(tokens), last_pass, mask)
            if ahead and ahead.pop(0) != p.get("token_id"):
                problems.append((_ids(event), f"token {len(tokens)} is {p.get('token_id')}, "
                                 "not the token written for it before it was committed"))
        elif event.event_type == "cache.rollback" and isinstance(p.get("cache_len"), int):
            cache = p["cache_len"]
        elif event.event_type == "decode.completed":
            ids, t = fed(event), len(tokens)
            if p.get("write") is False:
                if cache != m + t or p.get("cache_len") != cache:
                    problems.append((_ids(event), f"a denoising pass after {t} committed tokens "
                                     f"saw cache length {p.get('cache_len')} (walked: {cache}); "
                                     f"the cache must hold exactly m+{t}={m + t}"))
                last_pass = event
                continue
            lacks = m + t - cache  # committed tokens the cache does not hold yet
            if (ahead or not 0 <= lacks <= len(ids)
                    or list(ids[:lacks]) != tokens[len(tokens) - lacks:]):
                problems.append((_ids(event), f"a cache write of {len(ids)} tokens at cache "
                                 f"length {cache} after {t} committed tokens: it must first write "
                                 f"the last {lacks} committed tokens, the ones the cache lacks"))
            ahead = list(ids[max(lacks, 0):])  # the rest: the block's tokens committed next
            if p.get("cache_len") != cache + len(ids):
                problems.append((_ids(event), f"cache length {p.get('cache_len')} after writing "
                                 f"{len(ids)} tokens at {cache}"))
            cache = p["cache_len"] if isinstance(p.get("cache_len"), int) else cache
    steps = sorted(trace.by_step("token.selected"))
    if steps != list(range(1, len(steps) + 1)):
        problems.append(((), f"selected steps {steps} are not 1..{len(steps)}"))
    return Finding(tuple(problems), ("iterative strategy: checked the block-wise cache walk "
                                     "in place of one token per step",))


def _reuse(event: Event, previous: Event | None) -> list[tuple[tuple[int, ...], str]]:
    """A pass marked ``reused`` must follow a pass over the same block that committed
    nothing and left the block as this one was fed."""
    if not event.payload.get("reused"):
        return []
    p = previous.payload if previous is not None else {}
    if previous is None or p.get("committed") != 0 or p.get("step") != event.payload.get(
            "step") or p.get("state_digest") != event.payload.get("input_digest"):
        return [(_ids(previous, event), "a pass reused the previous pass's logits, but that "
                 "pass was over another block or changed it: the logits are stale")]
    return []


def _from_pass(event: Event, t: int, last: Event | None, mask: Any
               ) -> list[tuple[tuple[int, ...], str]]:
    """Token t must come from the latest denoising pass over its block (and, where the pass
    fed token ids rather than embeddings, be the id it held there or a mask)."""
    if last is None:
        return [(_ids(event), f"token {t} was committed before any denoising pass")]
    s, ids = last.payload.get("step"), fed(last)
    if not isinstance(s, int) or not s < t <= s + len(ids):
        return [(_ids(last, event), f"token {t} was committed after a pass over positions "
                 f"{s}+1..{s}+{len(ids)}, which do not include it")]
    if last.payload.get("inputs") == "embeddings":  # placeholder ids: nothing to compare
        return []
    if ids[t - s - 1] not in (event.payload.get("token_id"), mask):
        return [(_ids(last, event), f"token {t} is {event.payload.get('token_id')}, but the "
                 f"pass it came from held {ids[t - s - 1]} there")]
    return []


def _cache_walk(trace: Trace, m: int, selected: Mapping[int, Event]
                ) -> list[tuple[tuple[int, ...], str]]:
    """Follow the cache length through every call and rollback, in causal order."""
    out: list[tuple[tuple[int, ...], str]] = []
    cache = m
    for event in trace.events:
        p = event.payload
        if event.event_type == "cache.rollback":
            positions, length = p.get("positions"), p.get("cache_len")
            if isinstance(positions, int) and length != cache - positions:
                out.append((_ids(event), f"rolling back {positions} of {cache} positions left "
                            f"{length}; expected {cache - positions}"))
            cache = length if isinstance(length, int) else cache
            continue
        if event.event_type != "decode.completed" or not isinstance(p.get("step"), int):
            continue
        if p.get("write") is False:  # an iterative strategy's pass over a block: no write
            if p.get("cache_len") != cache:
                out.append((_ids(event), f"a call that does not write changed the cache "
                            f"from {cache} to {p.get('cache_len')}"))
            continue
        t, ids = p["step"], fed(event)
        if cache != m + t - 1:
            out.append((_ids(event), f"decode {t} fed the cache at length {cache}; the prompt "
                        f"and tokens 1..{t - 1} make m+t-1={m + t - 1}"))
        if p.get("cache_len") != m + t - 1 + len(ids):
            what = "m+t" if len(ids) == 1 else f"m+t+{len(ids) - 1} (with {len(ids) - 1} drafts)"
            out.append((_ids(event), f"cache length {p.get('cache_len')} after decode {t}; "
                        f"expected {what}={m + t - 1 + len(ids)}"))
        chosen = selected.get(t)
        if chosen is None or chosen.event_id > event.event_id:
            out.append((_ids(event), f"decode {t} ran before token {t} was selected"))
        elif chosen.payload.get("token_id") != p.get("token_id"):
            out.append((_ids(chosen, event), f"decode {t} wrote token {p.get('token_id')}, "
                        f"the selector chose {chosen.payload.get('token_id')}"))
        cache = p["cache_len"] if isinstance(p.get("cache_len"), int) else cache
    return out


def _conditioned(t: int, event: Event, source: Event, selected: Mapping[int, Event]
                 ) -> list[tuple[tuple[int, ...], str]]:
    """Token t came from a call at step s that fed y_s and drafts: every draft fed before
    its position must be the token committed at that step."""
    s, ids = source.payload["step"], fed(source)
    out: list[tuple[tuple[int, ...], str]] = []
    if source.payload.get("write") is False:  # it fed embeddings (placeholder ids), no drafts
        return out
    for i in range(1, min(t - s, len(ids))):
        committed = selected.get(s + i)
        if committed is not None and committed.payload.get("token_id") != ids[i]:
            out.append((_ids(source, committed, event), f"token {t} was selected from logits "
                        f"that assume draft {ids[i]} at step {s + i}, where "
                        f"{committed.payload.get('token_id')} was committed"))
            break
    return out


def _selection_order(t: int, event: Event, ready: Event | None, m: Any
                     ) -> list[tuple[tuple[int, ...], str]]:
    out: list[tuple[tuple[int, ...], str]] = []
    if event.payload.get("cache_len") != (m or 0) + t - 1:
        out.append((_ids(event), f"token {t} selected with cache length "
                    f"{event.payload.get('cache_len')}; expected m+t-1={(m or 0) + t - 1}"))
    if ready is None or ready.event_id > event.event_id:
        if ready is not None and ready.event_type == "decode.completed":
            source = f"decode {ready.payload.get('step')}"
        else:
            source = "prefill" if t == 1 else f"decode {t - 1}"
        out.append((_ids(event), f"token {t} selected before {source} produced its logits"))
    return out


def processor_order(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 4: every applied order (step 1's, and each change recorded later) is a
    subsequence of the declared order."""
    configured = trace.first("selection.configured")
    if configured is None:
        return Finding(notes=("no selection happened",))
    inst = trace.instance
    declared = (inst.get("generation_config") or {}).get("processor_order") or inst.get(
        "processor_chain")
    if declared is None:
        return Finding(notes=("the execution instance declares no processor chain",))
    problems: list[tuple[tuple[int, ...], str]] = []
    changes = [configured] + [e for e in trace.of("token.selected") if "processors" in e.payload]
    for event in changes:
        applied = list(event.payload.get("processors", []))
        rest = iter(declared)
        if not all(name in rest for name in applied):  # `in` on an iterator consumes
            where = f" at step {event.payload['step']}" if "step" in event.payload else ""
            problems.append((_ids(trace.first("request.normalized"), event),
                             f"applied order {applied}{where} is not in the declared order "
                             f"{list(declared)}"))
    first = trace.by_step("token.selected").get(1)
    if first is not None and first.event_id < configured.event_id:
        problems.append((_ids(configured, first), "a token was selected before the processor "
                         "order was fixed"))
    return Finding(tuple(problems))


def stream_prefix(trace: Trace, detokenize: Detokenize | None) -> Finding:
    """Invariant 5: deltas in order, accounting for exactly the selected tokens, and their
    text (``full``) a prefix of the detokenized selected tokens."""
    end = trace.finished.event_id if trace.finished is not None else None
    deltas = [e for e in trace.of("stream.delta") if end is None or e.event_id < end]
    selected = trace.by_step("token.selected")
    ids = [selected[t].payload.get("token_id", -1) for t in sorted(selected)]
    problems: list[tuple[tuple[int, ...], str]] = []
    text, tokens, full = "", 0, all("text" in d.payload for d in deltas)
    for seq, delta in enumerate(deltas):
        p = delta.payload
        step, tokens = p.get("step", 0), tokens + p.get("tokens", 0)
        if p.get("seq") != seq:
            problems.append((_ids(delta), f"delta seq {p.get('seq')} where {seq} was due"))
        if tokens != step or step > len(ids) or (
                step and selected[step].event_id > delta.event_id):
            problems.append((_ids(delta), f"{tokens} tokens streamed by step {step}, which had "
                             "not all been selected or were skipped"))
        if full:
            text += p["text"]
            problems += _content(delta, text, ids[:step], detokenize)
    finished = trace.finished
    if full and finished is not None and "text_digest" in finished.payload and digest_text(
            text) != finished.payload["text_digest"]:
        problems.append((_ids(finished), "the streamed text is not the text the run ended with"))
    notes = []
    if not full:
        notes.append("digest-level trace: checked order and token accounting, not the bytes")
    elif detokenize is None:
        notes.append("no tokenizer given: checked digests, not the prefix property")
    return Finding(tuple(problems), tuple(notes))


def _content(delta: Event, text: str, ids: Sequence[int], detokenize: Detokenize | None
             ) -> list[tuple[tuple[int, ...], str]]:
    p = delta.payload
    out: list[tuple[tuple[int, ...], str]] = []
    if digest_text(p["text"]) != p.get("digest") or len(p["text"].encode()) != p.get("bytes"):
        out.append((_ids(delta), "the delta's text does not match its digest or length"))
    if detokenize is not None:
        expected = detokenize(ids).rstrip("\ufffd")  # an incomplete last character is unsafe
        if not expected.startswith(text):
            out.append((_ids(delta), f"streamed {text[-40:]!r} is not a prefix of the "
                        f"detokenized tokens {expected[-40:]!r}"))
    return out


def terminal(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 6: one ending; nothing ordinary after it; the final delta is the last."""
    ends = trace.of("generation.finished")
    if not ends:
        return Finding(notes=("the request has not ended",))
    end = ends[0]
    problems: list[tuple[tuple[int, ...], str]] = []
    if len(ends) > 1:
        problems.append((_ids(*ends), "the request ended more than once"))
    late = ("stream.delta", "token.selected", "decode.completed", "prefill.chunk",
            "prefill.completed")
    for event in trace.events:
        if event.event_id > end.event_id and event.event_type in late:
            problems.append((_ids(end, event), f"{event.event_type} after the request "
                             f"{end.payload.get('state')} ({end.payload.get('reason')})"))
    deltas = [d for d in trace.of("stream.delta") if d.event_id < end.event_id]
    for d in deltas[:-1]:
        if d.payload.get("final"):
            problems.append((_ids(d), "a final delta that is not the last one"))
    if deltas and not deltas[-1].payload.get("final"):
        problems.append((_ids(deltas[-1], end), "the stream ended without a final delta"))
    state = TERMINAL_STATE.get(str(end.payload.get("reason")), "finished")
    if end.payload.get("state") != state:
        problems.append((_ids(end), f"reason {end.payload.get('reason')} ends in state {state}, "
                         f"not {end.payload.get('state')}"))
    return Finding(tuple(problems))


def _calls(trace: Trace) -> dict[str, dict[str, Event]]:
    """Each call's first event of each ``tool.*`` kind, by ``call_id``."""
    calls: dict[str, dict[str, Event]] = {}
    for event in trace.events:
        if event.event_type.startswith("tool."):
            call = str(event.payload.get("call_id"))
            calls.setdefault(call, {}).setdefault(event.event_type[5:], event)
    return calls


GATES = ("parsed", "validated", "authorized", "committed")
"""What a call passes, in this order, before its executor may run (docs/design.md §11)."""
REFUSALS = ("invalid", "denied", "cancelled", "skipped", "malformed")
"""Ends of a call that never crossed the boundary: nothing may execute after them."""


def tool_gate(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 7: ``tool.executed`` only after parsed, validated, authorized (with an
    ``allow`` decision) and committed, in that order, for the same call; never for a call
    that was refused (invalid, denied, cancelled before its commit, skipped)."""
    calls = _calls(trace)
    if not calls:
        return Finding(notes=("no tool calls in this trace",))
    problems: list[tuple[tuple[int, ...], str]] = []
    for call, seen in calls.items():
        executed = seen.get("executed")
        if executed is None:
            continue
        problems += _gates(call, seen, executed)
        for refusal in REFUSALS:
            if refusal in seen:
                problems.append((_ids(seen[refusal], executed), f"tool call {call} executed "
                                 f"although it was {refusal}"))
    return Finding(tuple(problems))


def _gates(call: str, seen: Mapping[str, Event], executed: Event
           ) -> list[tuple[tuple[int, ...], str]]:
    out: list[tuple[tuple[int, ...], str]] = []
    last = 0
    for gate in GATES:
        before = seen.get(gate)
        if before is None or before.event_id > executed.event_id:
            out.append((_ids(executed), f"tool call {call} executed before it was {gate}"))
            continue
        if before.event_id < last:
            out.append((_ids(before), f"tool call {call} was {gate} out of order"))
        last = before.event_id
    authorized, validated = seen.get("authorized"), seen.get("validated")
    if authorized is not None and authorized.payload.get("decision", "allow") != "allow":
        out.append((_ids(authorized, executed), f"tool call {call} executed on the decision "
                    f"{authorized.payload.get('decision')!r}"))
    if validated is not None and validated.payload.get("valid", True) is not True:
        out.append((_ids(validated, executed), f"tool call {call} executed with arguments "
                    "that did not validate"))
    return out


def commit_boundary(trace: Trace, _: Detokenize | None) -> Finding:
    """Invariant 8: a committed call keeps an outcome (executed or failed) and runs at most
    once; a cancel after its commit is recorded as ``tool.cancel_after_commit``, never as a
    rollback or a cancellation of the call; compensation only undoes an executed call."""
    committed = {c: s for c, s in _calls(trace).items() if "committed" in s}
    if not committed:
        return Finding(notes=("no write crossed the commit boundary",))
    problems: list[tuple[tuple[int, ...], str]] = []
    runs: dict[str, list[Event]] = {}
    for event in trace.of("tool.executed"):
        runs.setdefault(str(event.payload.get("call_id")), []).append(event)
    for call, seen in committed.items():
        for undo in ("rolled_back", "cancelled"):
            if undo in seen:
                problems.append((_ids(seen["committed"], seen[undo]), f"tool call {call} was "
                                 f"{undo.replace('_', ' ')} after it was committed"))
        outcome = seen.get("executed") or seen.get("failed")
        if outcome is None and trace.finished is not None:
            problems.append((_ids(seen["committed"]), f"tool call {call} was committed but its "
                             "outcome is missing from the trace"))
        if len(runs.get(call, ())) > 1:
            problems.append((_ids(*runs[call]), f"tool call {call} executed more than once"))
        problems += _after_commit(call, seen, outcome)
    return Finding(tuple(problems))


def _after_commit(call: str, seen: Mapping[str, Event], outcome: Event | None
                  ) -> list[tuple[tuple[int, ...], str]]:
    out: list[tuple[tuple[int, ...], str]] = []
    cancel, commit = seen.get("cancel_after_commit"), seen["committed"]
    if cancel is not None and (cancel.event_id < commit.event_id or outcome is None
                               or cancel.event_id < outcome.event_id):
        out.append((_ids(commit, cancel), f"the cancel of tool call {call} is not recorded "
                    "after its commit and its outcome"))
    compensated, executed = seen.get("compensated"), seen.get("executed")
    if compensated is not None and (executed is None or
                                    compensated.event_id < executed.event_id):
        out.append((_ids(compensated), f"tool call {call} was compensated before it executed"))
    return out


RULES: Mapping[int, Callable[[Trace, Detokenize | None], Finding]] = {
    0: structure, 1: provenance, 2: cache_layers, 3: step_order, 4: processor_order,
    5: stream_prefix, 6: terminal, 7: tool_gate, 8: commit_boundary,
}
