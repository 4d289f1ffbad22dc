"""The configuration reference (docs/config_reference.md), generated from the schema.

Every field's documentation is the string literal under it in schema.py; this module reads
those with `ast` (they are not attributes at run time) and walks the dataclasses from
`MegaRLConfig` down, so the reference can never list a key the loader would reject or miss
one it accepts. `tools/gen_config_reference.py` writes it; a unit test fails when it is stale.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from . import schema
from .loader import YAML_LIMITS
from .schema import CHOICES, RANGES, MegaRLConfig

HEADER = """# Configuration reference

Generated from `megarl/config/schema.py` by `python tools/gen_config_reference.py`; do not
edit by hand. Every key can be set in YAML or on the command line (`key=value`, `+key=value`).
Aliases: `trainer.sperated_node_tasks` / `trainer.sperated_node_ratios` mean the
`separated_*` keys.

Values are checked when the config loads, before anything starts: a bool takes only
`true`/`false` (never 0 or 1), a number must be finite (no `.nan`/`.inf`, in any key, the open
`model.override_config` included) and inside the Range given below, and an int must fit in 64
bits. A config file must be UTF-8 YAML of at most {bytes:,} bytes, nested at most {depth}
deep, with at most {values:,} values once aliases are expanded and {chars:,} characters per
value.
""".format(**YAML_LIMITS)


def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the docstring under that field."""
    tree = ast.parse(inspect.getsource(schema))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out.setdefault(node.name, {})
        body = node.body
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[a.target.id] = " ".join(b.value.value.split())
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return None if dataclasses.is_dataclass(value) else value
    return None


def _type_name(tp) -> str:
    name = getattr(tp, "__name__", None)
    return name if name and not typing.get_args(tp) else str(tp).replace("typing.", "")


def render() -> str:
    docs = field_docs()
    lines = [HEADER]

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((tp, key))
                continue
            doc = docs.get(cls.__name__, {}).get(f.name, "")
            if key in CHOICES:
                doc += " Choices: " + ", ".join(f"`{c}`" for c in CHOICES[key]) + "."
            if key in RANGES:
                each = " each" if typing.get_origin(tp) is list else ""
                doc += f" Range: {RANGES[key].describe()}{each}."
            default = repr(_default(f)).replace("|", "\\|")
            rows.append(f"| `{key}` | {_type_name(tp)} | `{default}` | {doc.replace('|', '/')} |")
        if rows:
            section = prefix.rstrip(".") or "(top level)"
            lines.extend([f"\n## `{section}`\n", "| key | type | default | meaning |",
                          "|---|---|---|---|", *rows])
        for tp, key in nested:
            walk(tp, key + ".")

    walk(MegaRLConfig, "")
    return "\n".join(lines) + "\n"
