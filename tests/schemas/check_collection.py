#!/usr/bin/env python3
"""Check tests/schemas/collection.json.

For every entry the schema must be a valid JSON Schema for its draft (the
validator class comes from jsonschema.validators.validator_for, so "$schema"
is honoured and the default is the latest draft, 2020-12), it must not use
keywords that its own draft ignores, and its bundled "instance" must validate
against it with format checking on (the jsonschema.FormatChecker of the
schema's draft; see format_checker_for).  Names must be unique kebab-case and
there must be at least 200 entries.

Prints counts of entries by category and by size, of every keyword (schemas
using it / occurrences, walking every subschema) and of some finer features
(formats by name, kinds of "not", recursive "$ref", ...).  Exits non-zero on
any problem.

Usage: python tests/schemas/check_collection.py [path/to/collection.json]
"""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

import jsonschema
from jsonschema.validators import validator_for

DEFAULT_PATH = Path(__file__).with_name("collection.json")
MIN_ENTRIES = 200
CATEGORIES = {"api", "config", "event", "form", "extraction", "tool"}
NAME_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")

# Keywords whose value is a map from names to subschemas.
MAP_OF_SCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# Keywords whose value is one subschema (or, for draft-07 "items", possibly a list of them).
ONE_SCHEMA = {"additionalProperties", "items", "additionalItems", "not", "if", "then", "else",
              "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
# Keywords whose value is a list of subschemas.
LIST_OF_SCHEMAS = {"allOf", "anyOf", "oneOf", "prefixItems"}
# Everything else ("enum", "const", "default", "examples", "required", ...) is data: not walked.

# Keywords that one dialect ignores although another defines them: a schema
# that uses them under the wrong "$schema" does not say what it seems to say.
ONLY_IN_2019_OR_LATER = {"$defs", "prefixItems", "dependentRequired", "dependentSchemas",
                         "unevaluatedProperties", "unevaluatedItems", "minContains", "maxContains",
                         "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef"}
ONLY_UP_TO_DRAFT_7 = {"dependencies", "additionalItems"}

Schema = dict[str, Any]
Visitor = Callable[[Schema, str], None]


def walk(schema: Any, visit: Visitor, path: str = "#") -> None:
    """Call visit(subschema, path) for every subschema object, in every position."""
    if not isinstance(schema, dict):
        return  # boolean schemas have no keywords
    visit(schema, path)
    for key, value in schema.items():
        if key in MAP_OF_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                walk(sub, visit, f"{path}/{key}/{name}")
        elif key in ONE_SCHEMA:
            if isinstance(value, list):  # draft-07 tuple form of "items"
                for i, sub in enumerate(value):
                    walk(sub, visit, f"{path}/{key}/{i}")
            else:
                walk(value, visit, f"{path}/{key}")
        elif key in LIST_OF_SCHEMAS and isinstance(value, list):
            for i, sub in enumerate(value):
                walk(sub, visit, f"{path}/{key}/{i}")
        elif key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):  # the schema form; the array form is data
                    walk(sub, visit, f"{path}/{key}/{name}")


def dialect_problems(schema: Schema, cls: Any) -> list[str]:
    """Keywords that the schema's own draft would silently ignore."""
    found: list[str] = []
    old_draft = "draft-0" in str(cls.META_SCHEMA.get("$schema", ""))

    def visit(sub: Schema, path: str) -> None:
        for key, value in sub.items():
            if old_draft and key in ONLY_IN_2019_OR_LATER:
                found.append(f"{path}: {key!r} is ignored by {cls.__name__}")
            if not old_draft and key in ONLY_UP_TO_DRAFT_7:
                found.append(f"{path}: {key!r} is ignored by {cls.__name__}")
            if not old_draft and key == "items" and isinstance(value, list):
                found.append(f"{path}: array-form 'items' is not valid in {cls.__name__}")
        if old_draft and "$ref" in sub and len(sub) > 1:
            found.append(f"{path}: keywords next to '$ref' are ignored by {cls.__name__}")

    walk(schema, visit)
    return found


def analyse(schema: Schema) -> tuple[collections.Counter[str], set[str], int, set[str]]:
    """Return (keyword occurrences, feature tags, number of property definitions, formats)."""
    keywords: collections.Counter[str] = collections.Counter()
    tags: set[str] = set()
    formats: set[str] = set()
    prop_count = 0

    def visit(sub: Schema, path: str) -> None:
        nonlocal prop_count
        for key, value in sub.items():
            keywords[key] += 1
            if key == "properties" and isinstance(value, dict):
                prop_count += len(value)
            elif key == "format":
                formats.add(str(value))
            elif key == "type" and isinstance(value, list):
                tags.add("type-list")
            elif key == "additionalProperties":
                if value is False:
                    tags.add("additionalProperties:false")
                elif isinstance(value, dict):
                    tags.add("additionalProperties:schema")
            elif key == "dependencies" and isinstance(value, dict):
                for dep in value.values():
                    tags.add("dependencies:array" if isinstance(dep, list) else "dependencies:schema")
            elif key == "not" and isinstance(value, dict):
                for k in ("required", "type", "enum", "const"):
                    if k in value:
                        tags.add(f"not:{k}")
            elif key == "$ref" and isinstance(value, str):
                # Recursive: the reference points at a definition it sits inside, or at the root.
                if value == "#" or path == value or path.startswith(value + "/"):
                    tags.add("recursive-$ref")

    walk(schema, visit)
    if schema.get("additionalProperties") is False:
        tags.add("additionalProperties:false (at the root)")
    if "$schema" in schema:
        uri = str(schema["$schema"])
        tags.add("$schema:" + ("draft-07" if "draft-07" in uri else "2020-12" if "2020-12" in uri else uri))
    tags.update("format:" + fmt for fmt in formats)
    return keywords, tags, prop_count, formats


def format_checker_for(cls: Any) -> jsonschema.FormatChecker:
    """The jsonschema.FormatChecker for the schema's draft.

    A bare jsonschema.FormatChecker() merges the checkers of every draft, and
    for "time" the draft-3 one (HH:MM:SS, no offset) wins, so an RFC 3339
    time such as "09:30:00Z" would be rejected.  The validator class's own
    FORMAT_CHECKER (a jsonschema.FormatChecker restricted to that draft's
    formats) checks "time" as RFC 3339 and every other format the same way.
    Which formats are actually checked depends on the optional packages
    installed (e.g. "uri" needs rfc3987, "date-time" needs rfc3339-validator);
    unknown formats such as "phone" or "color" are ignored, as the spec says.
    """
    checker = getattr(cls, "FORMAT_CHECKER", None)
    return checker if isinstance(checker, jsonschema.FormatChecker) else jsonschema.FormatChecker()


def size_class(prop_count: int) -> str:
    if prop_count <= 5:
        return "small (<=5 properties)"
    if prop_count <= 15:
        return "medium (6-15 properties)"
    return "large (>15 properties)"


def check_entry(index: int, entry: Any, problems: list[str]) -> Schema | None:
    """Validate one entry; return its schema when it is usable for the statistics."""
    label = f"entry {index}"
    if not isinstance(entry, dict) or set(entry) != {"name", "category", "schema", "instance"}:
        problems.append(f"{label}: must be an object with exactly name, category, schema, instance")
        return None
    label = f"entry {index} ({entry['name']!r})"
    if not isinstance(entry["name"], str) or not NAME_RE.match(entry["name"]):
        problems.append(f"{label}: name is not kebab-case")
    if entry["category"] not in CATEGORIES:
        problems.append(f"{label}: unknown category {entry['category']!r}")
    schema, instance = entry["schema"], entry["instance"]
    if not isinstance(schema, dict):
        problems.append(f"{label}: schema must be an object")
        return None
    try:
        cls = validator_for(schema)
        cls.check_schema(schema)
        validator = cls(schema, format_checker=format_checker_for(cls))
        errors = sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    except jsonschema.SchemaError as exc:
        problems.append(f"{label}: invalid schema: {exc.message}")
        return None
    except Exception as exc:  # unresolvable $ref, bad regex and the like
        problems.append(f"{label}: error while validating: {exc!r}")
        return None
    for msg in dialect_problems(schema, cls):
        problems.append(f"{label}: {msg}")
    for err in errors:
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        problems.append(f"{label}: instance invalid at {where}: {err.message}")
    return schema


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else DEFAULT_PATH
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot load {path}: {exc}")
        return 1
    if not isinstance(entries, list):
        print(f"{path}: the top level must be a JSON array")
        return 1

    problems: list[str] = []
    if len(entries) < MIN_ENTRIES:
        problems.append(f"only {len(entries)} entries; at least {MIN_ENTRIES} required")

    names: collections.Counter[str] = collections.Counter()
    by_category: collections.Counter[str] = collections.Counter()
    by_size: collections.Counter[str] = collections.Counter()
    schemas_using: collections.Counter[str] = collections.Counter()  # keyword -> schemas using it
    keyword_total: collections.Counter[str] = collections.Counter()  # keyword -> occurrences
    tag_count: collections.Counter[str] = collections.Counter()
    format_schemas = 0

    for index, entry in enumerate(entries):
        schema = check_entry(index, entry, problems)
        if isinstance(entry, dict):
            names[str(entry.get("name"))] += 1
            by_category[str(entry.get("category"))] += 1
        if schema is None:
            continue
        keywords, tags, prop_count, formats = analyse(schema)
        by_size[size_class(prop_count)] += 1
        format_schemas += bool(formats)
        schemas_using.update(keywords.keys())
        keyword_total.update(keywords)
        tag_count.update(tags)

    problems.extend(f"duplicate name {name!r} ({n} times)" for name, n in names.items() if n > 1)

    print(f"entries: {len(entries)}")
    print("by category:")
    for cat, n in sorted(by_category.items()):
        print(f"  {cat:<12} {n:>4}")
    print("by size (property definitions in the whole schema):")
    for size, n in sorted(by_size.items()):
        print(f"  {size:<26} {n:>4}")
    print("keywords: schemas using / total occurrences")
    for kw, n in sorted(schemas_using.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {kw:<24} {n:>4} / {keyword_total[kw]}")
    print("features: schemas using")
    print(f"  {'any format':<42} {format_schemas:>4}")
    for tag, n in sorted(tag_count.items()):
        print(f"  {tag:<42} {n:>4}")

    if problems:
        print(f"\n{len(problems)} problem(s):")
        for problem in problems:
            print("  " + problem)
        return 1
    print("\nOK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
