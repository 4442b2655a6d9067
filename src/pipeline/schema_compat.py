"""JSON Schema keywords the grammar engine lacks, rewritten into ones it has.

Owns :func:`rewrite`, applied to every caller schema before it is compiled
(:func:`pipeline.grammar.annotations_dropped` calls it for each subschema). Each rewrite gives a
schema whose instances are instances of the original (never more), so an output valid for the
rewrite is valid for what the caller sent; where that cannot be had, the keyword stays and the
engine's refusal names it with its JSON Pointer.

- ``dependentRequired`` and ``dependencies`` with a list (``{"a": ["b"]}``: with ``a``, also
  ``b``): ``allOf`` of ``anyOf: [{"required": ["a", "b"]}, {"properties": {"a": false}}]``.
- ``dependentSchemas`` and ``dependencies`` with a schema: the same, the schema joining the
  first branch.
- ``not``, where its complement is a schema: ``not {"required": [...]}`` (one of them absent),
  ``not {"type": ...}`` (the other types), ``not {"const"/"enum"}`` over a sibling ``enum``, a
  boolean or an integer (the other values; an integer's neighbours as ranges). Any other
  ``not`` is refused.
- ``propertyNames`` with only a ``pattern`` (or an ``enum``) on an object without
  ``properties``: ``patternProperties`` (or ``properties``) of the additional-property schema,
  and nothing else allowed.
- ``oneOf`` whose branches exclude one another: ``anyOf`` (exactly one then holds). Branches
  exclude one another when they allow different types, or require one property with
  different constant values, or are told apart by required properties (each branch then
  forbids the properties only the others require). Otherwise refused, naming where.
- ``if``/``then``/``else`` whose condition is one property's constant (``{"properties": {"k":
  {"const": v}}}``, ``required`` or not) and whose sibling ``k`` is an ``enum`` or a boolean:
  ``anyOf`` of the condition with ``then`` and of the other values with ``else``.

Numbers end (the engine would let an integer run on for as long as the budget lasts): every
``integer`` and ``number`` the schema types is bounded (:func:`_bounded`), the result again
allowing nothing the original forbids:

- an ``integer`` within the schema's ``minimum``/``maximum`` (or exclusive variants) where
  given, and on a side not given within ±(2^53 − 1) (:data:`INTEGER_BOUND`: the integers an
  IEEE double, so every JSON parser, keeps exactly);
- a ``number`` with both bounds given: those, and at most :data:`FRACTION_DIGITS` digits
  after the point (``multipleOf`` 10^-6); with a ``multipleOf`` of its own: that, and a side not
  given within ±(10^15 − 1) (:data:`NUMBER_BOUND`); otherwise written with at most 15
  significant digits (:data:`TIERS`: below 10^9 in magnitude with up to six digits after the
  point, or an integer below 10^15), within the one bound given;
- a number is never written with an exponent (the engine writes bounded numbers as plain
  decimals). A schema's own bound beyond a default on the other side (``minimum`` 10^20 and
  no ``maximum``) is left as the schema gives it;
- a value the schema leaves open (:func:`open_values_bounded`: ``true`` or ``{}``, the
  additional properties of an object and the items of an array it does not describe, any
  value of ``json_object`` mode) is any JSON value whose numbers have the default shape: a
  reference to :data:`ANY` (added to the root's ``$defs`` as :data:`ANY_NAME`). Not inside
  ``allOf`` branches or next to ``allOf``/``anyOf``/``oneOf``/``$ref`` (where the engine
  would have to intersect it), nor at a position with keywords but no ``type``: numbers
  there are not bounded (the budget steering still ends them).

``uniqueItems`` is not rewritten: no grammar compares items. :func:`without_unique` takes it
out of the engine's copy of a schema (the :class:`~pipeline.grammar.Grammar` keeps it), and the
grammar processor enforces it while the output is generated.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
             "propertyNames", "unevaluatedProperties", "unevaluatedItems",
             "additionalItems")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                  "dependentSchemas", "dependencies")
"""The keywords whose value is a subschema, a list of them, or a mapping of names to them."""


def subschemas(node: Mapping[str, Any], pointer: str
               ) -> Iterator[tuple[str, str | int | None, str, Any]]:
    """Each subschema of ``node`` in a schema position: ``(keyword, index or name within it,
    JSON Pointer, subschema)``; a property *named* like a keyword is never one."""
    for key, value in node.items():
        at = f"{pointer}/{escape_pointer(key)}"
        if key in SUBSCHEMA:
            yield key, None, at, value
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                yield key, i, f"{at}/{i}", item
        elif key in SUBSCHEMA_MAPS and isinstance(value, Mapping):
            for name, item in value.items():
                yield key, name, f"{at}/{escape_pointer(name)}", item


def escape_pointer(name: str) -> str:
    """``name`` as one token of a JSON Pointer (``~`` and ``/`` escaped)."""
    return name.replace("~", "~0").replace("/", "~1")


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The schema at a local JSON pointer (``#``, ``#/$defs/x``); None for anything else
    (a remote reference, an anchor, a path that is not there)."""
    if pointer != "#" and not pointer.startswith("#/"):
        return None
    node = root
    for raw in pointer[2:].split("/") if pointer != "#" else []:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node

TYPES = ("null", "boolean", "object", "array", "number", "string")
INTEGER_BOUND = 2**53 - 1
"""Integers without a bound of the schema's on a side stay within ±this: the range every JSON
parser keeps exactly (an IEEE double holds every integer up to 2^53)."""
FRACTION_DIGITS = 6
"""Digits after the point of a ``number`` without a ``multipleOf`` of its own."""
NUMBER_BOUND = 10**15 - 1
"""A ``number``'s bound on a side the schema leaves open (15 integer digits)."""
ANY_NAME = "pipeline_any"
"""The name of :data:`ANY` among the root's ``$defs``."""
ANY_REF = {"$ref": f"#/$defs/{ANY_NAME}"}
"""A reference to :data:`ANY` (where an open value was)."""
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$schema", "$id", "$anchor"})
"""Keywords that assert nothing: a subschema of only these allows any value."""
TIERS: list[dict[str, Any]] = [
    {"minimum": -999_999_999.999_999, "maximum": 999_999_999.999_999,
     "multipleOf": 10.0**-FRACTION_DIGITS},
    {"minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": 1}]
"""The default shape of a ``number``: at most 15 significant digits (nine before the point
and six after, or fifteen and none), so a double keeps the value as written."""


ANY: dict[str, Any] = {"anyOf": [
    {"type": ["null", "boolean", "string"]},
    {"type": "number", "allOf": [{"anyOf": TIERS}]},
    {"type": "array", "items": ANY_REF},
    {"type": "object", "additionalProperties": ANY_REF}]}
"""Any JSON value, its numbers (at any depth) in the default shape of :data:`TIERS`."""


def open_values_bounded(schema: Any) -> Any:
    """``schema`` (already tidied) with the values it leaves open bounded (see the module
    docstring): each open position a reference to :data:`ANY`, defined in the root's
    ``$defs`` when used (``true`` itself becomes that reference)."""
    if _is_open(schema):
        return {**ANY_REF, "$defs": {ANY_NAME: copy.deepcopy(ANY)}}
    if not isinstance(schema, dict) or ANY_NAME in (schema.get("$defs") or {}):
        return schema   # ``false``, or a name of the caller's: as it is
    shared: set[str] = set()
    _shared_refs(schema, shared)
    out = _close(copy.deepcopy(schema), False, frozenset(shared), "#")
    if json.dumps(ANY_REF)[1:-1] in json.dumps(out):
        out["$defs"] = {**(out.get("$defs") or {}), ANY_NAME: copy.deepcopy(ANY)}
    return out


def _is_open(node: Any) -> bool:
    """Whether ``node`` allows any value (``true``, or only annotations)."""
    return node is True or isinstance(node, Mapping) and set(node) <= ANNOTATIONS


def _shared_refs(node: Any, out: set[str], shared: bool = False) -> None:
    """Add to ``out`` each ``$ref`` written beside other assertions, or below a keyword of
    :data:`SHARED` (its schema is then intersected with others)."""
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and (shared or set(node) - ANNOTATIONS - {"$ref"}):
            out.add(ref)
        for key, value in node.items():
            _shared_refs(value, out, shared or key in SHARED)
    elif isinstance(node, list):
        for value in node:
            _shared_refs(value, out, shared)


SHARED = frozenset({"allOf", "then", "else", "dependentSchemas", "contains",
                    "patternProperties"})
"""Keywords whose subschemas apply to a value together with its other keywords' (the engine
would intersect an open value's bound with them): left open below."""


def _close(node: Any, shared: bool, refs: frozenset[str], pointer: str) -> Any:
    """:func:`open_values_bounded` below the root: ``node``'s open subschemas replaced (in
    place) and an object's or array's unstated additional values bounded, unless ``shared``
    (another schema applies to the same value: see :data:`SHARED`); ``refs`` are the
    definitions referenced beside other keywords, ``pointer`` where ``node`` is."""
    if not isinstance(node, dict):
        return node
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    alone = not shared and not any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref"))
    if alone and "object" in kinds and _is_open(node.get("additionalProperties", True)):
        node["additionalProperties"] = dict(ANY_REF)
    if alone and "array" in kinds and not isinstance(node.get("items"), list) \
            and _is_open(node.get("items", True)):
        node["items"] = dict(ANY_REF)
    for key, value in node.items():
        inner = shared or key in SHARED
        if key in ("items", "additionalProperties", "then", "else", "contains",
                  "additionalItems"):
            node[key] = _close(value, inner, refs, f"{pointer}/{key}")
        elif key in ("properties", "patternProperties", "$defs", "definitions",
                     "dependentSchemas") and isinstance(value, dict):
            for name, sub in value.items():
                at = f"{pointer}/{key}/{name.replace('~', '~0').replace('/', '~1')}"
                within = inner or (key in ("$defs", "definitions") and at in refs)
                value[name] = (dict(ANY_REF) if _is_open(sub) and not within
                               else _close(sub, within, refs, at))
        elif key in ("anyOf", "oneOf", "prefixItems", "allOf") and isinstance(value, list):
            node[key] = [dict(ANY_REF) if _is_open(sub) and not inner
                         else _close(sub, inner, refs, f"{pointer}/{key}/{i}")
                         for i, sub in enumerate(value)]
    return node


def rewrite(node: dict[str, Any], root: Any, siblings: Mapping[str, Any] | None = None
            ) -> dict[str, Any]:
    """:func:`_rewrite`, or ``node`` as it was when a keyword's value is malformed (the engine
    then refuses it, naming it)."""
    try:
        return _rewrite(copy.deepcopy(node), root, siblings)
    except (TypeError, AttributeError, ValueError, KeyError):
        return node


def _rewrite(node: dict[str, Any], root: Any, siblings: Mapping[str, Any] | None = None
             ) -> dict[str, Any]:
    """``node`` (one subschema, already copied, its own subschemas already rewritten) with
    the keywords above rewritten in place and returned. ``root`` is the whole schema (for
    local local references); ``siblings`` are the ``properties`` of the object schema ``node``
    applies to when it is an ``allOf`` branch of it (where a condition's property is
    declared)."""
    props = node.get("properties") if isinstance(node.get("properties"), Mapping) else None
    context = props if props is not None else siblings
    extra: list[Any] = []
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        value = node.get(key)
        if isinstance(value, Mapping) and _dependencies(value, extra):
            del node[key]
    if "not" in node:
        done = _not(node, node["not"], context)
        if done:
            del node["not"]
    if "propertyNames" in node:
        _property_names(node)
    if "if" in node:
        branch = _condition(node, context)
        if branch is not None:
            for key in ("if", "then", "else"):
                node.pop(key, None)
            extra.append(branch)
    if isinstance(node.get("oneOf"), list):
        exclusive = _exclusive(node["oneOf"], root)
        if exclusive is not None:
            del node["oneOf"]
            extra.append({"anyOf": exclusive})
    _bounded(node, extra)
    if extra:
        node["allOf"] = [*(node.get("allOf") or []), *extra]
    return node


def _bounded(node: dict[str, Any], extra: list[Any]) -> None:
    """Bound ``node``'s integers or numbers where it leaves them open (see the module
    docstring); a tier choice goes to ``extra`` (the node's ``allOf``). Nothing for a node
    that types neither, lists its values (``enum``, ``const``), or whose bounds are not
    numbers (draft 4's boolean ``exclusive*``)."""
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if "number" not in kinds and "integer" not in kinds or "enum" in node or "const" in node:
        return   # an enum or a constant ends by itself
    low, high = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum",
                                                                    "exclusiveMaximum")
    if low is False or high is False:
        return
    grid = "multipleOf" in node
    if "number" not in kinds or grid:
        edge = INTEGER_BOUND if "number" not in kinds else NUMBER_BOUND
        if low is None and (high is None or high >= -edge):
            node["minimum"] = -edge
        if high is None and (low is None or low <= edge):
            node["maximum"] = edge
    elif low is not None and high is not None:
        node["multipleOf"] = 10.0**-FRACTION_DIGITS
    elif (low is None or low < NUMBER_BOUND) and (high is None or high > -NUMBER_BOUND):
        extra.append({"anyOf": copy.deepcopy(TIERS)})


def _bound(node: Mapping[str, Any], word: str, exclusive: str) -> float | None | bool:
    """The schema's bound on one side (the stricter of ``word`` and ``exclusive``; None when
    it gives neither), or False when one is not a number."""
    values = [node[k] for k in (word, exclusive) if k in node]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        return False
    if not values:
        return None
    found: float = max(values) if word == "minimum" else min(values)
    return found


def _dependencies(value: Mapping[str, Any], extra: list[Any]) -> bool:
    """Append each dependency as an ``anyOf`` to ``extra``; False (nothing appended) when one
    is neither a list of names nor a schema."""
    parts = []
    for name, need in value.items():
        absent = {"properties": {name: False}}
        if isinstance(need, list) and all(isinstance(n, str) for n in need):
            parts.append({"anyOf": [{"required": [name, *need]}, absent]})
        elif isinstance(need, (Mapping, bool)):
            parts.append({"anyOf": [{"allOf": [{"required": [name]}, need]}, absent]})
        else:
            return False
    extra.extend(parts)
    return True


def _not(node: dict[str, Any], negated: Any, context: Mapping[str, Any] | None) -> bool:
    """Rewrite ``node["not"]`` into positive keywords of ``node``; False when it cannot."""
    if not isinstance(negated, Mapping) or len(negated) != 1:
        return False
    (word, value), = negated.items()
    if word == "required" and isinstance(value, list) and value \
            and all(isinstance(n, str) for n in value):   # an object lacking one of them
        node.setdefault("allOf", []).append(
            {"anyOf": [{"type": "object", "properties": {name: False}} for name in value]})
        return True
    if word == "type":
        if not (isinstance(value, str) or isinstance(value, list)
                and all(isinstance(t, str) for t in value)):
            return False
        banned = {value} if isinstance(value, str) else set(value)
        if not banned <= {*TYPES, "integer"}:
            return False
        if "integer" in banned and "number" not in banned:
            return False
        own = node.get("type")
        allowed = ([own] if isinstance(own, str) else list(own)) if own else list(TYPES)
        kept = [t for t in allowed if t not in banned and not (t == "integer" and "number"
                                                                in banned)]
        if not kept:
            return False
        node["type"] = kept
        return True
    if word in ("const", "enum"):
        banned_values = [value] if word == "const" else value
        return isinstance(banned_values, list) and _other_values(node, banned_values)
    return False


def _other_values(node: dict[str, Any], banned: list[Any]) -> bool:
    """Keep ``node``'s values other than ``banned``: a sibling ``enum``/``const`` filtered, a
    boolean's other value, an integer's neighbouring ranges."""
    gone = {_canonical(v) for v in banned}
    if isinstance(node.get("enum"), list):
        node["enum"] = [v for v in node["enum"] if _canonical(v) not in gone]
        return bool(node["enum"])
    if node.get("type") == "boolean":
        left = [v for v in (True, False) if _canonical(v) not in gone]
        if not left:
            return False
        node["enum"] = left
        return True
    if node.get("type") == "integer" and all(isinstance(v, int) and not isinstance(v, bool)
                                             for v in banned):
        gaps: list[dict[str, Any]] = []
        low: int | None = None
        for v in sorted(set(banned)):
            gaps.append({"maximum": v - 1} if low is None else
                        {"minimum": low, "maximum": v - 1})
            low = v + 1
        gaps.append({"minimum": low})
        node.setdefault("allOf", []).append({"anyOf": gaps})
        return True
    return False


def _property_names(node: dict[str, Any]) -> None:
    """``propertyNames`` as ``patternProperties`` / ``properties`` where that is exact."""
    names = node["propertyNames"]
    if not isinstance(names, Mapping) or node.get("properties") or node.get("patternProperties"):
        return
    each = node.get("additionalProperties", True)
    if set(names) == {"pattern"} and isinstance(names["pattern"], str):
        node["patternProperties"] = {names["pattern"]: each}
    elif set(names) == {"enum"} and isinstance(names["enum"], list) \
            and all(isinstance(n, str) for n in names["enum"]):
        node["properties"] = {n: copy.deepcopy(each) for n in names["enum"]}
    else:
        return
    node["additionalProperties"] = False
    del node["propertyNames"]


def _condition(node: dict[str, Any], context: Mapping[str, Any] | None) -> Any:
    """``if``/``then``/``else`` as ``{"anyOf": [...]}`` (None when the condition is not one
    property's constant over a declared enum or boolean)."""
    condition = node["if"]
    if not isinstance(condition, Mapping) or set(condition) - {"properties", "required"}:
        return None
    props = condition.get("properties")
    if not isinstance(props, Mapping) or len(props) != 1:
        return None
    (name, test), = props.items()
    if not isinstance(test, Mapping) or set(test) != {"const"}:
        return None
    required = condition.get("required", [])
    if required not in ([], [name]) or context is None or name not in context:
        return None
    declared = context[name]
    if not isinstance(declared, Mapping):
        return None
    if isinstance(declared.get("enum"), list):
        others = [v for v in declared["enum"] if v != test["const"]]
    elif declared.get("type") == "boolean" and isinstance(test["const"], bool):
        others = [not test["const"]]
    else:
        return None
    holds: dict[str, Any] = {"properties": {name: {"const": test["const"]}},
                             **({"required": [name]} if required else {})}
    then, other = node.get("then", True), node.get("else", True)
    branches: list[Any] = [{"allOf": [holds, then]}]
    if others:
        branches.append({"allOf": [{"properties": {name: {"enum": others}},
                                    "required": [name]}, other]})
    if required:   # the condition also fails when the property is absent
        branches.append({"allOf": [{"properties": {name: False}}, other]})
    return {"anyOf": branches}


def _exclusive(given: list[Any], root: Any) -> list[Any] | None:
    """``given`` made (or found) mutually exclusive, for ``anyOf``; None if they cannot be.
    A branch that is a local ``$ref`` is judged by the schema it names."""
    branches = [_deref(b, root) for b in given]
    if not all(isinstance(b, Mapping) for b in branches):
        return None
    types = [b.get("type") for b in branches]
    kinds = ["number" if t == "integer" else t for t in types]   # an integer is a number
    if all(isinstance(t, str) for t in types) and len(set(kinds)) == len(kinds):
        return list(given)
    if _discriminated(branches):   # exclusive among objects; other values pass every branch
        return [{"allOf": [{"type": "object"}, b]} for b in given]
    needs = [set(b.get("required", [])) if isinstance(b.get("required"), list) else set()
             for b in branches]
    if any(not n for n in needs):
        return None
    out = []
    for i, branch in enumerate(given):
        others = set().union(*(needs[j] - needs[i] for j in range(len(branches)) if j != i))
        if any(not (needs[j] - needs[i]) for j in range(len(branches)) if j != i):
            return None   # another branch requires nothing this one lacks: not separable
        out.append({"allOf": [branch, {"type": "object",
                                       "properties": {n: False for n in sorted(others)}}]})
    return out


def _discriminated(branches: list[Any]) -> bool:
    """Whether one property is required by every branch with a constant (``const`` or a
    one-value ``enum``) that differs from branch to branch."""
    common: set[str] | None = None
    for b in branches:
        required = set(b.get("required", [])) if isinstance(b.get("required"), list) else set()
        common = required if common is None else common & required
    for name in sorted(common or ()):
        values = []
        for b in branches:
            prop = (b.get("properties") or {}).get(name)
            if not isinstance(prop, Mapping):
                break
            if "const" in prop:
                values.append(_canonical(prop["const"]))
            elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
                values.append(_canonical(prop["enum"][0]))
            else:
                break
        else:
            if len(set(values)) == len(values):
                return True
    return False


def _canonical(value: Any) -> str:
    """``value`` as JSON Schema compares it: numbers by value (``1`` is ``1.0``, not
    ``true``), objects whatever their key order."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"n:{float(value)!r}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}"
                              for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


def _deref(node: Any, root: Any) -> Any:
    """The schema a local ``{"$ref": "#/..."}`` names (followed a few times), else ``node``."""
    for _ in range(8):
        if not (isinstance(node, Mapping) and set(node) == {"$ref"}):
            return node
        found = resolve_pointer(root, node["$ref"])
        if found is None:
            return node
        node = found
    return node


def without_unique(node: Any) -> Any:
    """``node`` (a schema) without any ``uniqueItems``, for the engine."""
    if not isinstance(node, Mapping):
        return node
    out = {k: v for k, v in node.items() if k != "uniqueItems"}
    for key, within, _, child in subschemas(node, ""):
        if within is None:
            out[key] = without_unique(child)
        else:
            out[key] = (list(out[key]) if isinstance(out[key], list) else dict(out[key]))
            out[key][within] = without_unique(child)
    return out
