"""docs/json.md's field tables, read as schemas, and a checker of real --json output against them.

Each table follows a `<!-- schema: NAME -->` comment; its rows are `| `path` | type | meaning |`.
A path is `a`, `a.b` (field of an object), `a[]` (element of an array), `[]` (element of the
top-level array). A type is alternatives joined by " or " (primitives, `{}`, or a shape's name
in backticks), optionally followed by ", optional". The check is strict both ways: a field the
doc lists and does not call optional must be there with one of its types, and a field the
output has must be listed (objects with no listed fields are free-form).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).parent.parent / "docs" / "json.md"
PRIMITIVES = {"string", "integer", "number", "boolean", "null", "object", "array", "{}"}


@dataclass(frozen=True)
class Field:
    types: tuple[str, ...]
    optional: bool


def load(doc: Path = DOC) -> dict[str, dict[str, Field]]:
    """{schema name: {path: Field}} from the doc."""
    schemas: dict[str, dict[str, Field]] = {}
    lines = doc.read_text().splitlines()
    name = None
    for line in lines:
        marker = re.fullmatch(r"<!-- schema: (.+?) -->", line.strip())
        if marker:
            name = marker.group(1)
            if name in schemas:
                raise ValueError(f"schema {name!r} defined twice in {doc}")
            schemas[name] = {}
            continue
        if name is None:
            continue
        if not line.startswith("|"):
            if schemas[name]:
                name = None  # the table has ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("field", "") or set(cells[0]) <= {"-"}:
            continue
        path = re.fullmatch(r"`([^`]*)`", cells[0])
        if not path:
            raise ValueError(f"{doc}: schema {name}: a path must be in backticks: {line}")
        schemas[name][path.group(1)] = _parse_type(cells[1], name, line)
    for schema_name, fields in schemas.items():
        if not fields:
            raise ValueError(f"{doc}: schema {schema_name} has no table")
        for f in fields.values():
            for t in f.types:
                if t not in PRIMITIVES and t not in schemas:
                    raise ValueError(f"{doc}: schema {schema_name}: unknown type {t!r}")
    return schemas


def _parse_type(text: str, schema: str, line: str) -> Field:
    optional = text.endswith(", optional")
    if optional:
        text = text[:-len(", optional")]
    types = tuple(t.strip().strip("`") for t in text.split(" or "))
    if not all(types):
        raise ValueError(f"schema {schema}: empty type in {line}")
    return Field(types, optional)


def check(value, schema: str, schemas: dict[str, dict[str, Field]] | None = None) -> list[str]:
    """What in value does not match the schema (empty: it matches)."""
    schemas = schemas or load()
    problems: list[str] = []
    _check_node(value, "", schemas[schema], schemas, schema, problems)
    return problems


def _children(fields: dict[str, Field], path: str) -> dict[str, Field]:
    prefix = f"{path}." if path else ""
    return {p[len(prefix):]: f for p, f in fields.items()
            if p.startswith(prefix) and p != path and re.fullmatch(r"[^.\[\]]+", p[len(prefix):])}


def _check_node(value, path: str, fields: dict[str, Field], schemas, schema: str, problems: list[str]) -> None:
    where = f"{schema}: {path or '(top)'}"
    if isinstance(value, dict):
        children = _children(fields, path)
        if not children:
            return  # free-form
        for key in value:
            if key not in children:
                problems.append(f"{where}: field {key!r} is not documented")
        for key, spec in children.items():
            child = f"{path}.{key}" if path else key
            if key not in value:
                if not spec.optional:
                    problems.append(f"{schema}: {child} is missing")
                continue
            _check_typed(value[key], child, spec, fields, schemas, schema, problems)
    elif isinstance(value, list):
        element = f"{path}[]"
        spec = fields.get(element)
        if spec is None:
            return
        for item in value:
            _check_typed(item, element, spec, fields, schemas, schema, problems)


def _check_typed(value, path: str, spec: Field, fields, schemas, schema: str, problems: list[str]) -> None:
    for t in spec.types:
        if t in PRIMITIVES:
            if _is(value, t):
                _check_node(value, path, fields, schemas, schema, problems)
                return
        elif isinstance(value, dict):
            nested: list[str] = []
            _check_node(value, "", schemas[t], schemas, t, nested)
            if not nested:
                return
            if len(spec.types) == 1:
                problems.extend(f"{schema}: {path}: {p}" for p in nested)
                return
    problems.append(f"{schema}: {path} is {value!r}, not {' or '.join(spec.types)}")


def _is(value, t: str) -> bool:
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if t == "object":
        return isinstance(value, dict)
    if t == "{}":
        return value == {}
    if t == "array":
        return isinstance(value, list)
    raise ValueError(t)


def assert_shape(value, schema: str) -> None:
    problems = check(value, schema)
    assert not problems, f"--json output of {schema!r} differs from docs/json.md:\n" + "\n".join(problems)


def assert_events(lines: list[str], schemas: dict[str, dict[str, Field]] | None = None) -> list[dict]:
    """`ckpt run --json` output: every line one event of a documented kind, of its shape."""
    import json

    schemas = schemas or load()
    events = []
    for line in lines:
        event = json.loads(line)
        assert isinstance(event, dict) and f"run: {event.get('event')}" in schemas, f"undocumented event: {line}"
        assert_shape(event, f"run: {event['event']}")
        events.append(event)
    return events
