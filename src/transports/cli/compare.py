"""The ``pipeline compare`` command: one request through two configurations, and where they
part, located to a step and a layer (:mod:`pipeline.compare`; docs/tracing.md).

Owns the command's options: the prompt, ``--model`` (both sides' model unless a side names
its own), ``--a`` and ``--b`` (a side's settings as ``KEY=VALUE``, repeated or joined by
commas: :data:`SIDE_KEYS`), the request's ``--max-tokens``, ``--temperature`` (default 0)
and ``--seed``, ``--no-taps`` and ``--json``. A side's key that is not known, or a value of
the wrong kind, is a usage error naming it.

Example::

    pipeline compare --model ./qwen3 --a backend=torch --b backend=transformers "Why?"
    pipeline compare --a dtype=float32 --b dtype=bfloat16 --max-tokens 48 "What is 2+2?"
    pipeline compare --a quantized=off --b quantized=on --json report.json "Hello"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidValueError

FLAGS = {"on": True, "off": False, "true": True, "false": False}

SIDE_KEYS: dict[str, tuple[str, str]] = {
    "model": ("build", "a model folder, GGUF file or name of its own"),
    "backend": ("build", "torch, gguf, transformers, or a plugin's"),
    "dtype": ("options", "float32, bfloat16 or float16"),
    "device": ("options", "cpu, cuda, cuda:N, mps"),
    "threads": ("options", "CPU threads (a whole number)"),
    "batch_invariant": ("options", "on or off"),
    "quantized": ("options", "on or off (GGUF files)"),
    "kv_cache_dtype": ("options", "int8"),
    "company": ("side", "other sequences in the same forwards (a whole number)"),
}
"""What ``--a`` and ``--b`` take: where each key goes (a ``build()`` argument, a backend
option, the comparison's own) and what it means."""

_WHOLE = ("threads", "company")
_FLAG = ("batch_invariant", "quantized")


def side(items: list[str] | None) -> dict[str, Any]:
    """``["backend=transformers,dtype=bfloat16"]`` → ``build()`` arguments for one side
    (backend options under ``options``; ``company`` at the top)."""
    out: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for item in items or []:
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, eq, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or not value.strip():
                raise InvalidValueError("side", pair, "must be KEY=VALUE, e.g. backend=torch")
            if key not in SIDE_KEYS:
                raise InvalidValueError("side", key, "is not a setting compare knows; use one "
                                        "of " + ", ".join(SIDE_KEYS))
            value = value.strip()
            parsed: Any = value
            if key in _WHOLE:
                if not value.isdigit():
                    raise InvalidValueError(key, value, "must be a whole number")
                parsed = int(value)
            elif key in _FLAG:
                if value.lower() not in FLAGS:
                    raise InvalidValueError(key, value, "must be on or off")
                parsed = FLAGS[value.lower()]
            where = SIDE_KEYS[key][0]
            (options if where == "options" else out)[key] = parsed
    if options:
        out["options"] = options
    return out


def add_parser(sub: Any) -> None:
    """Register ``pipeline compare``."""
    keys = "; ".join(f"{k} ({what})" for k, (_, what) in SIDE_KEYS.items())
    p = sub.add_parser(
        "compare", help="run one request through two configurations and locate where they "
        "part: the first different token, each step's logit difference against what the "
        "dtypes explain, the first layer beyond it",
        description=f"Each side's settings, as KEY=VALUE: {keys}.")
    p.add_argument("prompt", help="the user message both sides answer")
    p.add_argument("--model", default=None,
                   help="both sides' model (folder, GGUF file or name; default: "
                        "SmolLM2-135M-Instruct) unless a side gives model=...")
    p.add_argument("--a", action="append", metavar="KEY=VALUE",
                   help="side A's settings (repeat, or join with commas)")
    p.add_argument("--b", action="append", metavar="KEY=VALUE",
                   help="side B's settings (repeat, or join with commas)")
    p.add_argument("--max-tokens", type=_count, default=16,
                   help="tokens to generate on each side (default 16)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the request (default 0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="the request's seed")
    p.add_argument("--no-taps", action="store_true",
                   help="compare logits only (for a backend without layer taps)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the report as JSON to FILE")
    p.set_defaults(run=_compare)


def _count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (1..4096)")
    return int(text)


def _compare(args: argparse.Namespace) -> int:
    from pipeline.compare import compare_models

    import os

    a, b = side(args.a), side(args.b)
    if args.json is not None:  # refused now, not after both models ran
        folder = args.json.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK) or args.json.is_dir():
            raise InvalidValueError("--json", str(args.json), "must be a file in a folder "
                                    "that exists and can be written")
    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        options["seed"] = args.seed
    print("comparing: loading both sides...", file=sys.stderr)
    report = compare_models(args.model, args.prompt, a=a, b=b, taps=not args.no_taps,
                            **options)
    print(report.render())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0
