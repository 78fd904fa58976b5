"""The run config's field reference (docs/config.md), generated from the typed schema so the
documentation cannot drift from the code: `python -m fedtrain.config.doc > docs/config.md`."""

from __future__ import annotations

import json
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel

from fedtrain.config.changes import fixed_reason
from fedtrain.config.run_config import RunConfig

HEADER = """# Run config reference

Generated from `fedtrain.config.RunConfig` by `python -m fedtrain.config.doc > docs/config.md`
(a test checks it is current). A run config is YAML or JSON; unknown fields are refused.
Fields under `name`, `seed` and `model`, and `streaming.fragments` and `streaming.assign`
(with `streaming` itself: on or off), are fixed for the life of a run; every other field
can change live (admin API, dashboard, or SIGHUP) and takes effect at the next round boundary.
Every number must be finite (no `.inf`, `Infinity` or NaN) and within the range shown.
"""

_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return "(section)"
    value = field.default
    return "`null`" if value is None else f"`{json.dumps(value)}`"


def _type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " \\| ".join(str(a) for a in get_args(annotation))
    args = get_args(annotation)
    if args and get_origin(annotation) in (Union, UnionType):
        return " or ".join("null" if a is type(None) else _type(a) for a in args)
    if get_origin(annotation) is list:
        return f"list of {_type(args[0])}" if args else "list"
    text = getattr(annotation, "__name__", None) or str(annotation)
    for module in ("typing.", "fedtrain.config.run_config.", "fedtrain.config.model_config.",
                   "fedtrain.config.sections.", "fedtrain.config."):
        text = text.replace(module, "")
    return text


def _range(field: Any) -> str:
    """The field's bounds as " (range: > 0, <= 10)", or "" for an unbounded field."""
    parts = [f"{sign} {_number(getattr(m, attr))}"
             for kind, attr, sign in _BOUNDS for m in field.metadata if isinstance(m, kind)]
    return f" (range: {', '.join(parts)})" if parts else ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        sub = next((a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                    and issubclass(a, BaseModel)), None)
        if sub is not None:
            nested.append((path, sub))
            if field.default_factory is None:  # an optional section (null by default)
                rows.append(f"| `{path}` | section | `null` | {(field.description or '').strip()} |")
            continue
        fixed = " (fixed for the run)" if fixed_reason(path) is not None else ""
        meaning = (field.description or "").strip() + _range(field) + fixed
        rows.append(f"| `{path}` | {_type(annotation)} | {_default(field)} | {meaning} |")
    for path, sub in nested:
        doc = (sub.__doc__ or "").strip().splitlines()[0] if sub.__doc__ else ""
        rows.append(f"| **`{path}`** | | | {doc} |")
        rows.extend(_rows(sub, f"{path}."))
    return rows


def reference() -> str:
    lines = [HEADER, "| field | type | default | meaning |", "|---|---|---|---|", *_rows(RunConfig, "")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
