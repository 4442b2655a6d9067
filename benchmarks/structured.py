"""Benchmark: structured output on the schema collection, and forced tool calls, default model.

Over ``tests/schemas/collection.json`` (220 schemas written for the project, see its README):
the compile rate (each refusal names its JSON Pointer) and the median compile time; then, on
the embedded default model (``build()``, SmolLM2) at ``--max-tokens`` (256), one generation per
compiled schema (seeded, temperature 0.8, eight at a time): the rate of outputs that parse and
validate (``jsonschema`` with format checking, the schema's own draft), of requests refused
because the budget cannot hold any instance, and of outputs cut at the limit. The goals: at
least 97 % compiled, and 100 % of generated outputs valid. Then ``--seeds`` (100) forced tool
calls (``tool_choice="required"``) on the default model through the Hermes fallback: every
one must parse and validate. Prints a table and writes ``benchmarks/results/structured.json``
(with ``/proc/loadavg`` before and after).

Run: ``.venv/bin/python benchmarks/structured.py [--max-tokens 256] [--seeds 100]``;
``--smoke``: the same code in seconds on the tiny model (every schema compiled, one generated
at 64 tokens, one forced call): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema

from pipeline import Grammar, build
from pipeline.errors import InvalidValueError
from pipeline.contracts.request import ToolSpec

COLLECTION = Path(__file__).resolve().parents[1] / "tests" / "schemas" / "collection.json"
ASK = "Write one realistic example of the JSON object this describes: {name} ({category})."
TOOLS = [
    ToolSpec("get_weather", "The weather in a city.", {
        "type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    ToolSpec("search", "Search the web.", {
        "type": "object", "required": ["query"], "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}}),
]


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def _valid(schema: Any, text: str) -> str | None:
    """None when ``text`` is JSON valid for ``schema``, else why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    cls = jsonschema.validators.validator_for(schema)
    errors = sorted(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value),
                    key=str)
    return errors[0].message[:200] if errors else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--limit", type=int, default=0, help="schemas to generate for (0: all)")
    parser.add_argument("--model", default=None,
                        help="what build() takes (default: the default model)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/structured.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: one schema generated, one call")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.max_tokens, args.seeds, args.limit = "tiny", 64, 1, 1
    args.out = args.out or (Path(tempfile.gettempdir()) / "structured-smoke.json" if args.smoke
                            else Path(__file__).parent / "results" / "structured.json")
    before = _loadavg()
    entries = json.loads(COLLECTION.read_text())
    compiled, refused, times = [], [], []
    for entry in entries:
        t0 = time.perf_counter()
        try:
            Grammar.json_schema(entry["schema"])
            compiled.append(entry)
        except InvalidValueError as e:
            refused.append({"name": entry["name"], "why": str(e)[:300]})
        times.append(time.perf_counter() - t0)
    rate = len(compiled) / len(entries)
    print(f"compiled {len(compiled)} of {len(entries)} ({rate:.1%}), median "
          f"{statistics.median(times) * 1e3:.2f} ms; refused:")
    for r in refused:
        print(f"  {r['name']}: {r['why'][:160]}")
    pointed = sum(" at /" in r["why"] for r in refused)
    results: list[dict[str, Any]] = []
    todo = compiled[:args.limit] if args.limit else compiled
    with build(args.model, options={"num_slots": 8}) as pipe:
        t0 = time.perf_counter()
        for start in range(0, len(todo), 8):
            handles = []
            for i, entry in enumerate(todo[start:start + 8]):
                ask = ASK.format(name=entry["name"], category=entry["category"])
                try:
                    handles.append((entry, pipe.submit(
                        ask, json_schema=entry["schema"], max_tokens=args.max_tokens,
                        seed=start + i, temperature=0.8)))
                except InvalidValueError as e:
                    results.append({"name": entry["name"], "outcome": "budget_refused",
                                    "why": str(e)[:200]})
            for entry, handle in handles:
                done = handle.result()
                why = _valid(entry["schema"], done.text)
                outcome = ("valid" if why is None else
                           "cut" if done.finish_reason.value == "length" else "invalid")
                results.append({"name": entry["name"], "outcome": outcome, "why": why,
                                "tokens": len(done.token_ids),
                                "finish": done.finish_reason.value})
                if outcome != "valid":
                    print(f"  {entry['name']}: {outcome}: {why}  {done.text[:120]!r}")
            print(f"  {len(results)}/{len(todo)} schemas, {time.perf_counter() - t0:.0f} s",
                  flush=True)
        counts = {k: sum(r["outcome"] == k for r in results)
                  for k in ("valid", "invalid", "cut", "budget_refused")}
        generated = counts["valid"] + counts["invalid"] + counts["cut"]
        print(f"generated {generated}: valid {counts['valid']} "
              f"({counts['valid'] / max(generated, 1):.1%}), invalid {counts['invalid']}, cut "
              f"{counts['cut']}; refused for the budget {counts['budget_refused']}")
        calls = []
        handles = [pipe.submit([{"role": "user", "content": "What is the weather in Paris?"}],
                               tools=TOOLS, tool_choice="required", max_tokens=96, seed=s,
                               temperature=1.0) for s in range(args.seeds)]
        schemas = {t.name: dict(t.parameters) for t in TOOLS}
        for h in handles:
            done = h.result()
            ok = bool(done.tool_calls) and all(
                c.name in schemas and _valid(schemas[c.name], c.arguments) is None
                for c in done.tool_calls)
            calls.append(ok)
        print(f"forced calls through the fallback: {sum(calls)} of {len(calls)} parsed and "
              "valid")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "schemas": len(entries), "compiled": len(compiled), "compile_rate": rate,
        "refusals_with_pointer": pointed, "refused": refused,
        "compile_ms_median": statistics.median(times) * 1e3, "max_tokens": args.max_tokens,
        "generation": counts, "valid_rate": counts["valid"] / max(generated, 1),
        "results": results, "forced_calls": {"seeds": len(calls), "valid": sum(calls)},
        "loadavg_before": before, "loadavg_after": _loadavg(),
        "model": args.model or "default", "smoke": args.smoke}, indent=1))
    print(f"loadavg before {' '.join(before)}, after {' '.join(_loadavg())}; wrote {args.out}")


if __name__ == "__main__":
    main()
