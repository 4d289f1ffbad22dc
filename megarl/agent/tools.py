"""Tools a model may call during a multi-turn rollout: their specs, argument checks, built-ins.

A tool is a Python function plus an OpenAI-format description (name, description, JSON-schema
``parameters``). The model sees the description; the function is called with the arguments
the model wrote (checked against the schema first) and, as further keyword arguments, the
sample's own ``extra_info["tools_kwargs"][name]`` (verl's per-sample tool arguments: hidden
from the model, e.g. the table a lookup reads). Whatever it returns becomes the text of the
tool's answer (strings as they are, anything else as JSON).

``multi_turn.tools`` lists them: a built-in by name (``calculator``, ``python``, ``lookup``)
or ``{name, function: "module:function", description, parameters}``. Tool functions run in
worker processes (``megarl.agent.executor``), so a tool that hangs is killed at the limit.

The argument check is a deliberately small JSON-schema subset: an object whose ``required``
keys are present, no keys beyond ``properties`` unless ``additionalProperties`` allows them,
and each value of its declared ``type`` (string, integer, number, boolean, array, object).
"""
from __future__ import annotations

import ast
import json
import math
import operator
from typing import Any, Callable

from megarl.utils.errors import ConfigError
from megarl.utils.imports import check_import_path, load_callable

_KEY = "actor_rollout_ref.rollout.multi_turn.tools"

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,)}


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's schema; the message is shown to it."""


def check_arguments(schema: dict, args: Any) -> None:
    """Raise `ToolArgumentError` naming the first way `args` breaks `schema` (the subset in
    the module doc)."""
    if not isinstance(args, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(args).__name__}")
    props = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) or [] if k not in args]
    if missing:
        raise ToolArgumentError(f"missing required argument(s): {', '.join(missing)}")
    if not schema.get("additionalProperties", False):
        extra = sorted(set(args) - set(props))
        if extra:
            raise ToolArgumentError(f"unknown argument(s): {', '.join(extra)}")
    for k, v in args.items():
        want = (props.get(k) or {}).get("type")
        if want is None:
            continue
        ok = isinstance(v, _TYPES.get(want, (object,)))
        if want in ("integer", "number") and isinstance(v, bool):
            ok = False  # JSON true is not a number
        if not ok:
            raise ToolArgumentError(f"argument {k!r} must be of type {want}, "
                                    f"got {type(v).__name__}")


# ------------------------------------------------------------------ built-ins
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POW = 1000   # keeps 9**9**9 from eating the worker
_MAX_ABS = 1e100


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses; no names, no calls."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > _MAX_POW:
                raise ValueError(f"exponent {b} is too large")
            out = _BINOPS[type(node.op)](a, b)
            if abs(out) > _MAX_ABS:
                raise ValueError("result too large")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")
    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}: {err.msg}") from None
    value = ev(tree)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return str(value)


def python(code: str, time_limit_s: float = 5.0, memory_limit_mb: int = 256) -> str:
    """Run `code` in the reward sandbox (no network, time and memory limits); its stdout,
    or the error it ended with."""
    from megarl.reward.sandbox import run_program

    res = run_program(str(code), time_limit_s=float(time_limit_s),
                      memory_limit_mb=int(memory_limit_mb), max_output_bytes=1 << 16)
    if res.ok:
        return res.stdout
    tail = res.stderr.strip().splitlines()[-1:] or [""]
    return f"error ({res.status}): {tail[0]}"


def lookup(key: str, table: dict | None = None) -> str:
    """The value stored under `key` in this sample's table (``tools_kwargs.lookup.table``)."""
    table = table or {}
    k = str(key).strip()
    if k not in table:
        raise KeyError(f"no entry {k!r}")
    return str(table[k])


BUILTINS: dict[str, dict] = {
    "calculator": {
        "function": "megarl.agent.tools:calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string"}}}},
    "python": {
        "function": "megarl.agent.tools:python",
        "description": "Run a Python program (no network, limited time and memory) and "
                       "return what it prints.",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string"}}}},
    "lookup": {
        "function": "megarl.agent.tools:lookup",
        "description": "Look up the value stored under a key.",
        "parameters": {"type": "object", "required": ["key"],
                       "properties": {"key": {"type": "string"}}}},
}


def tool_specs(entries) -> list[dict]:
    """``multi_turn.tools`` as full specs {name, function, description, parameters}; raises
    ConfigError naming the entry. Imports nothing (the config check runs before any work)."""
    out, seen = [], set()
    for i, e in enumerate(list(entries or [])):
        key = f"{_KEY}[{i}]"
        if isinstance(e, str):
            if e not in BUILTINS:
                raise ConfigError(f"{key}: unknown built-in tool {e!r}; built-ins are "
                                  f"{sorted(BUILTINS)}, or give {{name, function, parameters}}")
            spec = {"name": e, **BUILTINS[e]}
        else:
            try:
                e = dict(e)
            except (TypeError, ValueError):
                raise ConfigError(f"{key}: a tool is a built-in's name or a mapping, "
                                  f"got {type(e).__name__}") from None
            unknown = sorted(set(e) - {"name", "function", "description", "parameters"})
            if unknown:
                raise ConfigError(f"{key}: unknown field(s) {unknown}")
            name = e.get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{key}.name: a tool needs a name")
            base = BUILTINS.get(name, {})
            spec = {"name": name, "function": e.get("function", base.get("function")),
                    "description": e.get("description", base.get("description", "")),
                    "parameters": e.get("parameters", base.get("parameters"))}
            if not spec["function"]:
                raise ConfigError(f"{key}.function: tool {name!r} needs an import path "
                                  "`module:function`")
            check_import_path(spec["function"], f"{key}.function")
            params = spec["parameters"]
            if params is None:
                params = {"type": "object", "properties": {}, "additionalProperties": True}
            params = _plain(params)
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise ConfigError(f"{key}.parameters: a JSON schema of type object")
            spec["parameters"] = params
        if spec["name"] in seen:
            raise ConfigError(f"{key}: tool name {spec['name']!r} given twice")
        seen.add(spec["name"])
        out.append(spec)
    return out


def _plain(x):
    # omegaconf containers -> dict/list, so the schema can be sent as JSON
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return x


def openai_tools(specs: list[dict]) -> list[dict]:
    """The tools as the chat template's ``tools=`` argument wants them (OpenAI format)."""
    return [{"type": "function", "function": {"name": s["name"], "description": s["description"],
                                              "parameters": s["parameters"]}} for s in specs]


def load_tools(specs_json: str) -> dict[str, tuple[Callable, dict]]:
    """name -> (function, parameters schema); imports the functions (in a tool worker)."""
    specs = json.loads(specs_json)
    return {s["name"]: (load_callable(s["function"], f"{_KEY}: {s['name']}.function"),
                        s["parameters"]) for s in specs}


def result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
