"""A request's JSON schema (a tool's parameters, a response_format), made safe to compile.

Checked in this order, so that no check recurses over an unbounded document:

1. size: one iterative walk over the document counts its nesting depth and its values; past
   `MAX_SCHEMA_DEPTH` or `MAX_SCHEMA_NODES` it is a 400 that names the limit. Every key and
   string is checked on the way (a lone surrogate or a NUL: a 400 naming where).
2. `$ref`: only references inside the document (`#`, `#/$defs/...`); a cycle among them
   (a recursive schema) is a 400 that names the cycle. The grammar engine cannot bound a
   recursive schema: a cycle with nothing in between makes it stop mid-value, and a reply
   cut there would read as complete.
3. the references are inlined (bounded by the same limits), so both paths, tools and
   response_format, compile the same self-contained schema (a tool's schema is nested inside
   the call's, where a `#/...` pointer would no longer resolve).
"""

from __future__ import annotations

import copy

from .errors import ApiError
from .schemas import storable

MAX_SCHEMA_DEPTH = 64  # nested objects and arrays of the document (about 32 levels of schema)
MAX_SCHEMA_NODES = 4000  # values in the document, after its $refs are expanded
MAX_REFS = 128  # distinct $ref targets


def _bad(message: str, param: str, code: str) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def measure(doc, param: str) -> None:
    """Depth, size and text of `doc`, without recursion."""
    stack = [(doc, 1, param)]
    nodes = 0
    while stack:
        node, depth, where = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _bad(f"{param} has more than {MAX_SCHEMA_NODES} values (the limit of a schema)", param,
                       "schema_too_large")
        if isinstance(node, str):
            storable(node, where)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise _bad(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep (the limit of a schema)", param,
                       "schema_too_deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str):
                storable(k, f"{where} (a key)")
            stack.append((v, depth + 1, f"{where}.{k}" if _plain(k) else f"{where}.?"))


def _plain(key) -> bool:
    """A key fit to be shown in a `param` (a bad one is refused as the key it is)."""
    return isinstance(key, int) or (len(key) <= 64 and key.isprintable() and key.isascii())


def _target(root, ref: str, param: str):
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise _bad(f"{param}: only $refs inside the schema are supported ('#/$defs/...'), got {ref!r}", param,
                   "unsupported_schema")
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _bad(f"{param}: $ref {ref!r} points at nothing in the schema", param, "invalid_schema")
    return node


def _refs_in(node) -> list[str]:
    """The $ref strings anywhere inside `node` (iterative)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if isinstance(n.get("$ref"), str):
                out.append(n["$ref"])
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return out


def _check_cycles(root, param: str) -> None:
    targets: dict[str, list[str]] = {}
    todo = _refs_in(root)
    while todo:
        ref = todo.pop()
        if ref in targets:
            continue
        if len(targets) >= MAX_REFS:
            raise _bad(f"{param} uses more than {MAX_REFS} distinct $refs (the limit of a schema)", param,
                       "schema_too_large")
        targets[ref] = _refs_in(_target(root, ref, param))
        todo.extend(targets[ref])
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in targets:
        if state.get(start):
            continue
        path, stack = [start], [iter(targets[start])]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                cycle = " -> ".join(path[path.index(nxt):] + [nxt])
                raise _bad(f"{param} is recursive ($ref cycle {cycle}); recursive schemas are not supported: "
                           "give the nesting a fixed depth", param, "schema_ref_cycle")
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(targets[nxt]))


def _inline(root, node, param: str, depth: int, count: list[int]):
    """`node` with every $ref replaced by (a copy of) its target; bounded by the limits, so
    the recursion is too."""
    count[0] += 1
    if count[0] > MAX_SCHEMA_NODES:
        raise _bad(f"{param} has more than {MAX_SCHEMA_NODES} values once its $refs are expanded", param,
                   "schema_too_large")
    if depth > MAX_SCHEMA_DEPTH:
        raise _bad(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep once its $refs are expanded",
                   param, "schema_too_deep")
    if isinstance(node, list):
        return [_inline(root, v, param, depth + 1, count) for v in node]
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$ref"), str):
        target = _inline(root, _target(root, node["$ref"], param), param, depth, count)
        rest = {k: v for k, v in node.items() if k != "$ref"}
        if not rest:
            return target
        return {"allOf": [target, _inline(root, rest, param, depth + 1, count)]}
    return {k: _inline(root, v, param, depth + 1, count) for k, v in node.items() if k not in ("$defs", "definitions")}


def prepare(schema: dict, param: str) -> dict:
    """The self-contained schema to validate and compile, or a 400 saying why not."""
    measure(schema, param)
    _check_cycles(schema, param)
    out = _inline(schema, copy.deepcopy(schema), param, 1, [0])
    if isinstance(schema, dict) and "$schema" in schema:
        out["$schema"] = schema["$schema"]
    return out
