"""Stock SGLang's wire contract, read from the pinned release's own files.

megarl talks to unmodified SGLang servers over HTTP and launches them with
`python -m sglang.launch_server`. This module owns checking that contract against the release
megarl pins (`megarl.backends.sglang.SGLANG_VERSION`) without installing or importing SGLang,
which needs a GPU stack:

- `fetch_release`: `pip download --no-deps` of that release's wheel into a cache
  (`$MEGARL_CACHE_DIR` or `~/.cache/megarl`, folder `sglang-<version>`) and extraction of the
  few source files read below. `RegistryUnreachable` when no package registry answers.
- `StockSGLang`, answering from those files:
  - requests: which JSON fields each endpoint reads (`request_fields`) and `check_request`,
    which fails on what stock SGLang would drop silently or reject. `/generate` and
    `/abort_request` are checked with the release's generated API types
    (`sglang/api/v1/api_types.py`, loaded by file path: it needs only msgspec), and the
    top-level fields only the handler's io_struct class reads with that class; the other
    endpoints with their request classes in `sglang/srt/managers/io_struct.py`, read with
    `ast` (which HTTP endpoint takes which class comes from `@app.post(...)` handlers in
    `sglang/srt/entrypoints/http_server.py`);
  - responses: `check_response` decodes a body with the generated response types;
  - the server's command line: `server_flags` / `server_flag` / `check_server_argv`, from the
    namespace classes in `sglang/srt/arg_groups/fields/*.py` (field `foo_bar` is `--foo-bar`
    unless its `Arg` says otherwise; verified against `arg_groups/arg_utils.py`) plus the flags
    `ServerArgs.add_cli_args` in `sglang/srt/server_args.py` registers by hand;
  - `requires_dist` / `pinned`: the wheel's own dependency pins (METADATA).

The tests' `stock_sglang` fixture (tests/contract/conftest.py) builds one per session.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import msgspec

# -- fetching the release ----------------------------------------------------------------------

API_TYPES = "sglang/api/v1/api_types.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_UTILS = "sglang/srt/arg_groups/arg_utils.py"
ARG_CHOICES = "sglang/srt/arg_groups/choices.py"
ARG_FIELDS_DIR = "sglang/srt/arg_groups/fields/"
METADATA = "METADATA"  # extracted from <dist-info>/METADATA
_NEEDED = (API_TYPES, IO_STRUCT, HTTP_SERVER, SERVER_ARGS, ARG_UTILS, ARG_CHOICES)
_DONE_MARK = ".extracted"

# Text pip prints when it cannot reach an index (urllib3/requests errors it retries on).
_UNREACHABLE_MARKERS = (
    "NewConnectionError", "Failed to establish a new connection", "Max retries exceeded",
    "Temporary failure in name resolution", "Name or service not known",
    "nodename nor servname", "Network is unreachable", "Connection refused",
    "ConnectTimeoutError", "ReadTimeoutError", "connection broken by", "ProxyError",
    "SSLError", "No route to host",
)
# Tried when the plain download finds no wheel for this interpreter/platform: the release's
# Linux x86-64 CPython 3.11 wheel. Only its .py files are read, so any platform's wheel will do.
_FALLBACK_PLATFORM = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                      "--implementation", "cp", "--abi", "cp311"]


class RegistryUnreachable(RuntimeError):
    """pip could not reach any package registry to fetch the release."""


def cache_dir(version: str) -> Path:
    root = os.environ.get("MEGARL_CACHE_DIR") or Path.home() / ".cache" / "megarl"
    return Path(root) / f"sglang-{version}"


def fetch_release(version: str) -> Path:
    """The folder holding the release's extracted source files (download and extract once)."""
    home = cache_dir(version)
    src = home / "src"
    if (src / _DONE_MARK).exists():
        return src
    home.mkdir(parents=True, exist_ok=True)
    wheel = _cached_wheel(home, version)
    if wheel is not None:
        try:
            _extract(wheel, src)
            return src
        except zipfile.BadZipFile:  # a damaged cached copy: fetch it again
            wheel.unlink()
    _extract(_pip_download(version, home), src)
    return src


def _cached_wheel(home: Path, version: str) -> Path | None:
    wheels = sorted(home.glob(f"sglang-{version}-*.whl"))
    return wheels[0] if wheels else None


def _pip_download(version: str, home: Path) -> Path:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"sglang=={version}", "-d", str(home), "--retries", "2", "--timeout", "60"]
    output = ""
    for extra in ([], _FALLBACK_PLATFORM):
        proc = subprocess.run(base + extra, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        wheel = _cached_wheel(home, version)
        if proc.returncode == 0 and wheel is not None:
            return wheel
        if any(marker in output for marker in _UNREACHABLE_MARKERS):
            lines = [line for line in output.splitlines() if line.strip()]
            raise RegistryUnreachable(f"no package registry reachable to fetch "
                                      f"sglang=={version}: {lines[-1] if lines else '(no output)'}")
    raise RuntimeError(f"pip download of sglang=={version} failed (a registry answered):\n"
                       f"{output[-3000:]}")


def _wanted(name: str) -> str | None:
    """Where a wheel member goes under src/, or None if it is not read."""
    if name in _NEEDED or (name.startswith(ARG_FIELDS_DIR) and name.endswith(".py")):
        return name
    if re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", name):
        return METADATA
    return None


def _extract(wheel: Path, src: Path) -> None:
    tmp = src.with_name(f"{src.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            dest = _wanted(name)
            if dest:
                (tmp / dest).parent.mkdir(parents=True, exist_ok=True)
                (tmp / dest).write_bytes(zf.read(name))
    missing = [p for p in (*_NEEDED, METADATA, ARG_FIELDS_DIR) if not (tmp / p).exists()]
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{wheel.name} lacks {missing}: SGLang moved files the contract "
                           f"checker reads; update tests/contract/stock_sglang.py")
    (tmp / _DONE_MARK).write_text(wheel.name)
    try:
        tmp.rename(src)
    except OSError:  # another process extracted it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (src / _DONE_MARK).exists():
            raise


# -- io_struct.py request classes, read with ast -----------------------------------------------

# BaseReq's fields are IPC routing (`rid`, `http_worker_ipc`), not something an HTTP client of
# these endpoints sends; /abort_request's `rid` is checked with api_types' AbortRequest.
_IPC_BASES = ("BaseReq", "BaseBatchReq")


@dataclass(frozen=True)
class StructField:
    name: str
    annotation: ast.expr  # as written in io_struct.py
    required: bool  # no default

    @property
    def type_text(self) -> str:
        return ast.unparse(self.annotation)


@dataclass(frozen=True)
class ReqStruct:
    """A request class of io_struct.py as its source declares it (it cannot be imported on CPU).

    `fields` are those an HTTP client may send: BaseReq's IPC fields are left out."""
    name: str
    fields: dict[str, StructField]


class _IoStructs:
    def __init__(self, path: Path):
        tree = ast.parse(path.read_text())
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.aliases = _module_assigns(tree)  # e.g. `WeightVersionSpans = List[...]`
        ipc = set()
        for base in _IPC_BASES:
            if base in self.classes:
                ipc |= set(self._fields(base))
        self.ipc_fields = ipc

    def _fields(self, name: str) -> dict[str, StructField]:
        cls = self.classes[name]
        out: dict[str, StructField] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in self.classes:
                out.update(self._fields(base.id))
        for stmt in cls.body:
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and "ClassVar" not in ast.unparse(stmt.annotation)):
                out[stmt.target.id] = StructField(stmt.target.id, stmt.annotation,
                                                  required=stmt.value is None)
        return out

    def get(self, name: str) -> ReqStruct:
        fields = {k: v for k, v in self._fields(name).items() if k not in self.ipc_fields}
        return ReqStruct(name, fields)


_JSON_SCALARS = {
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, str),  # base64 text over JSON
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "None": lambda v: v is None,
    "NoneType": lambda v: v is None,
}


def _head(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.List, t.Optional
        return node.attr
    return ""


def _mismatch(node: ast.expr, value: Any, aliases: dict, depth: int = 0) -> str | None:
    """None if JSON `value` fits the annotation `node`, else what was expected. Types this
    reader does not model (other classes, callables) accept anything."""
    if depth > 20:
        return None
    if isinstance(node, ast.Constant):
        if node.value is None:
            return None if value is None else "null"
        if isinstance(node.value, str):  # a string annotation
            return _mismatch(ast.parse(node.value, mode="eval").body, value, aliases, depth + 1)
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | Y
        return _union_mismatch([node.left, node.right], value, aliases, depth, node)
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = _head(node)
        if name in _JSON_SCALARS:
            return None if _JSON_SCALARS[name](value) else ast.unparse(node)
        if name in aliases:
            return _mismatch(aliases[name], value, aliases, depth + 1)
        return None
    if not isinstance(node, ast.Subscript):
        return None
    head = _head(node.value)
    args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    if head == "Optional":
        return None if value is None else _mismatch(args[0], value, aliases, depth + 1)
    if head == "Union":
        return _union_mismatch(args, value, aliases, depth, node)
    if head == "Annotated":
        return _mismatch(args[0], value, aliases, depth + 1)
    if head == "Literal":
        allowed = [a.value for a in args if isinstance(a, ast.Constant)]
        return None if value in allowed else f"one of {allowed}"
    if head in ("List", "list", "Sequence", "Set", "set", "Tuple", "tuple"):
        if not isinstance(value, list):
            return ast.unparse(node)
        if head in ("Tuple", "tuple") and not (len(args) == 2 and _is_ellipsis(args[1])):
            return None if len(args) == len(value) else ast.unparse(node)
        for item in value:
            if _mismatch(args[0], item, aliases, depth + 1) is not None:
                return ast.unparse(node)
        return None
    if head in ("Dict", "dict", "Mapping"):
        if not isinstance(value, dict):
            return ast.unparse(node)
        bad = [v for v in value.values() if _mismatch(args[-1], v, aliases, depth + 1)]
        return ast.unparse(node) if bad else None
    return None


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _union_mismatch(options, value, aliases, depth, node) -> str | None:
    if any(_mismatch(o, value, aliases, depth + 1) is None for o in options):
        return None
    return ast.unparse(node)


# -- http_server.py endpoints ------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    path: str
    methods: tuple[str, ...]
    handler: str
    body: str | None  # the class the handler takes its JSON body as; None: it reads no body
    query: tuple[str, ...]  # plain parameters FastAPI reads from the query string


_NOT_PARAMS = {"Request", "UploadFile", "Response", "BackgroundTasks"}
_QUERY_TYPES = {"int", "float", "str", "bool", "Optional"}


def _read_endpoints(path: Path) -> dict[str, list[Endpoint]]:
    out: dict[str, list[Endpoint]] = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in fn.decorator_list:
            route = _route(deco)
            if route is None:
                continue
            body, query = None, []
            for arg in fn.args.args + fn.args.kwonlyargs:
                ann = arg.annotation
                if ann is None:
                    continue
                if isinstance(ann, ast.Subscript) and _head(ann.value) == "Annotated":
                    inner, *meta = ann.slice.elts
                    if any(isinstance(m, ast.Call) and _head(m.func) == "Body" for m in meta):
                        if isinstance(inner, ast.Subscript) and _head(inner.value) == "Optional":
                            inner = inner.slice
                        body = ast.unparse(inner)
                        continue
                name = _head(ann.value) if isinstance(ann, ast.Subscript) else _head(ann)
                if name in _NOT_PARAMS:
                    continue
                if name in _QUERY_TYPES:
                    query.append(arg.arg)
                else:  # a model class FastAPI reads from the body
                    body = ast.unparse(ann)
            if body is None:
                body = _raw_body(fn)
            ep = Endpoint(route[0], route[1], fn.name, body, tuple(query))
            out.setdefault(ep.path, []).append(ep)
    return out


RAW_BODY = "<raw JSON>"


def _raw_body(fn: ast.AST) -> str | None:
    """For a handler that parses `await request.json()` itself: the class it builds from it
    (`X(**(await request.json()))`), else RAW_BODY; None if it reads no body."""
    reads = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr in ("json", "body", "form")
             and _head(n.func.value) in ("request", "raw_request")]
    if not reads:
        return None
    for call in ast.walk(fn):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and any(k.arg is None and any(n in reads for n in ast.walk(k.value))
                        for k in call.keywords)):
            return call.func.id
    return RAW_BODY


def _route(deco: ast.expr) -> tuple[str, tuple[str, ...]] | None:
    if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
            and _head(deco.func.value) == "app" and deco.args
            and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
        return None
    kind = deco.func.attr
    if kind in ("get", "post", "put", "delete"):
        return deco.args[0].value, (kind.upper(),)
    if kind == "api_route":
        methods = next((ast.literal_eval(k.value) for k in deco.keywords if k.arg == "methods"),
                       ["GET"])
        return deco.args[0].value, tuple(m.upper() for m in methods)
    return None


# -- server command line -----------------------------------------------------------------------

@dataclass(frozen=True)
class ServerFlag:
    flag: str  # "--tp-size"
    dest: str  # the ServerArgs field it sets
    arity: str  # "none" (a switch), "one", argparse's "?", "*" or "+", or "any" (custom action)
    choices: tuple | None  # allowed values where the source states them literally


def _literal(node: ast.expr | None, names: dict[str, ast.expr]):
    """Evaluate a literal, or a name bound to one in `names`; None when not literal."""
    if node is None:
        return None
    if isinstance(node, ast.Name) and node.id in names:
        node = names[node.id]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _module_assigns(tree: ast.Module) -> dict[str, ast.expr]:
    return {n.targets[0].id: n.value for n in tree.body
            if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)}


def _arity(nargs) -> str:
    """argparse's nargs as an arity: "one" (nargs=None), "?", "*" or "+"."""
    return "one" if nargs is None else str(nargs)


def _flags_of_field(stmt: ast.AnnAssign, names: dict) -> list[ServerFlag]:
    """The flags `add_cli_args_from_dataclass` (arg_utils.py) registers for one field."""
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and _head(ann.value) in ("A", "Annotated")):
        return []  # not a CLI field (or registered by hand in add_cli_args)
    typ, meta = ann.slice.elts[0], ann.slice.elts[1]
    field = stmt.target.id
    kw: dict[str, ast.expr] = {}
    if isinstance(meta, ast.Call) and _head(meta.func) == "Arg":
        kw = {k.arg: k.value for k in meta.keywords}
    elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
        return []
    if _literal(kw.get("no_cli"), names):
        return []
    cli = _literal(kw.get("cli_name"), names) or "--" + field.replace("_", "-")
    options = [cli] + list(_literal(kw.get("aliases"), names) or [])
    nargs = _literal(kw.get("nargs"), names)
    choices = _literal(kw.get("choices"), names)
    # Unwrap Optional[T] / T | None.
    if isinstance(typ, ast.Subscript) and _head(typ.value) == "Optional":
        typ = typ.slice
    elif isinstance(typ, ast.BinOp) and isinstance(typ.op, ast.BitOr):
        typ = typ.right if ast.unparse(typ.left) == "None" else typ.left
    action = kw.get("action")
    if action is not None:
        if _head(action) == "BooleanOptionalAction":
            options += ["--no-" + o[2:] for o in options if o.startswith("--")]
            arity = "none"
        else:
            akw = kw.get("action_kwargs")
            akw = ({k.value: v for k, v in zip(akw.keys, akw.values)}
                   if isinstance(akw, ast.Dict) else {})
            arity = _arity(_literal(akw.get("nargs"), names)) if "nargs" in akw else "any"
    elif isinstance(typ, ast.Subscript) and _head(typ.value) == "Literal":
        values = typ.slice.elts if isinstance(typ.slice, ast.Tuple) else [typ.slice]
        choices = choices or [_literal(v, names) for v in values]
        arity = "one"
    elif (isinstance(typ, ast.Subscript) and _head(typ.value) in ("List", "list")
          and "type_parser" not in kw):
        arity = _arity(nargs or "+")
    elif _head(typ) == "bool":
        arity = "none"
    else:
        arity = _arity(nargs)
    choices = tuple(choices) if isinstance(choices, (list, tuple, set)) else None
    return [ServerFlag(o, field, arity, choices) for o in options]


def _flags_added_by_hand(fn: ast.FunctionDef) -> list[ServerFlag]:
    """`parser.add_argument(...)` calls in ServerArgs.add_cli_args."""
    out = []
    for call in ast.walk(fn):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        options = [a.value for a in call.args
                   if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kw = {k.arg: k.value for k in call.keywords}
        action = kw.get("action")
        action_text = ast.unparse(action) if action is not None else ""
        choices = _literal(kw.get("choices"), {})
        if re.search(r"store_true|store_false|StoreTrue", action_text):
            arity = "none"
        elif action is None:
            arity = _arity(_literal(kw.get("nargs"), {}))
        else:
            arity = "any"
        dest = _literal(kw.get("dest"), {}) or options[0].lstrip("-").replace("-", "_")
        out += [ServerFlag(o, dest, arity, tuple(choices) if choices else None) for o in options]
    return out


# -- the contract ------------------------------------------------------------------------------

# Endpoints whose JSON is checked with the generated API types rather than io_struct.
API_TYPES_REQUESTS = {"/generate": "GenerateRequest", "/abort_request": "AbortRequest"}
API_TYPES_RESPONSES = {
    "/generate": "GenerateResponse",
    "/model_info": "GetModelInfoResponse",
    "/get_model_info": "GetModelInfoResponse",
    "/server_info": "GetServerInfoResponse",
    "/get_server_info": "GetServerInfoResponse",
    "/abort_request": "AbortResponse",
}

RequestClass = Union[type, ReqStruct]


class StockSGLang:
    """One stock SGLang release's HTTP and CLI contract (see the module docstring)."""

    def __init__(self, root: Path, version: str):
        self.root, self.version = Path(root), version
        self.api = self._load_api_types()
        self._io = _IoStructs(self.root / IO_STRUCT)

    @classmethod
    def fetch(cls, version: str) -> "StockSGLang":
        return cls(fetch_release(version), version)

    def _load_api_types(self):
        name = f"_stock_sglang_{self.version.replace('.', '_')}_api_types"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, self.root / API_TYPES)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the postponed annotations through it
        spec.loader.exec_module(module)
        return module

    def _where(self, path: str) -> str:
        return f"stock SGLang {self.version} {path}"

    # -- endpoints --------------------------------------------------------------------------
    @cached_property
    def endpoints(self) -> dict[str, list[Endpoint]]:
        return _read_endpoints(self.root / HTTP_SERVER)

    def endpoint(self, path: str) -> Endpoint:
        """The handler of `path` (the one taking a body where several share the path)."""
        eps = self.endpoints.get(path)
        if not eps:
            raise AssertionError(f"stock SGLang {self.version} serves no endpoint {path}")
        return next((e for e in eps if e.body), eps[0])

    def request_class(self, path: str) -> RequestClass | None:
        """The api_types Struct (for /generate, /abort_request) or the io_struct class
        (`ReqStruct`) the endpoint reads its JSON body as; None where it reads no body."""
        if path in API_TYPES_REQUESTS:
            self.endpoint(path)
            return getattr(self.api, API_TYPES_REQUESTS[path])
        body = self.endpoint(path).body
        if body is None:
            return None
        if body not in self._io.classes:
            raise NotImplementedError(f"{self._where(path)} reads {body}, which this checker "
                                      f"does not model")
        return self._io.get(body)

    def request_fields(self, path: str) -> set[str]:
        cls = self.request_class(path)
        if cls is None:
            return set()
        if isinstance(cls, ReqStruct):
            return set(cls.fields)
        return {f.name for f in msgspec.structs.fields(cls)}

    def query_params(self, path: str) -> set[str]:
        return set(self.endpoint(path).query)

    def check_request(self, path: str, body: dict | None) -> None:
        """AssertionError, naming the endpoint and the field, if `body` has a field stock
        SGLang does not read there (it would be dropped, or for sampling params rejected), a
        value of the wrong JSON type or outside a Literal, or lacks a required field."""
        cls = self.request_class(path)
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise AssertionError(f"{self._where(path)}: the body must be a JSON object, "
                                 f"got {type(body).__name__}")
        if cls is None:
            if body:
                raise AssertionError(
                    f"{self._where(path)} reads no JSON body; field(s) "
                    f"{', '.join(f'`{k}`' for k in body)} would be ignored "
                    f"(query parameters: {sorted(self.query_params(path))})")
            return
        if isinstance(cls, ReqStruct):
            self._check_io_struct(path, cls, body)
        else:
            body = self._check_handler_only_fields(path, cls, body)
            self._check_api_value(path, cls.__name__, cls, body)
            try:
                cls.from_json_value(body)
            except self.api.JsonContractError as e:
                raise AssertionError(f"{self._where(path)}: {cls.__name__}: {e}") from None

    def _check_handler_only_fields(self, path: str, cls, body: dict) -> dict:
        """The body without the top-level fields the API types lack but the handler's own
        io_struct parameter reads (`/generate`'s `return_routed_experts` is one: the contract
        gate passes keys it does not know, and `GenerateReqInput` reads it), each of those
        checked against that class's annotation."""
        handler_cls = self.endpoint(path).body
        if handler_cls not in self._io.classes:
            return body
        io = self._io.get(handler_cls)
        api_fields = {f.name for f in msgspec.structs.fields(cls)}
        extra = {k: v for k, v in body.items() if k not in api_fields and k in io.fields}
        if extra:
            self._check_io_struct(path, io, extra)
        return {k: v for k, v in body.items() if k not in extra}

    def _check_io_struct(self, path: str, cls: ReqStruct, body: dict) -> None:
        for key, value in body.items():
            field = cls.fields.get(key)
            if field is None:
                raise AssertionError(
                    f"{self._where(path)}: field `{key}` is not one {cls.name} reads (stock "
                    f"SGLang would drop it); fields: {sorted(cls.fields) or 'none'}")
            expected = _mismatch(field.annotation, value, self._io.aliases)
            if expected is not None:
                raise AssertionError(
                    f"{self._where(path)}: field `{key}` = {json.dumps(value)[:200]}: "
                    f"{cls.name}.{key} is {field.type_text}, expected {expected}")
        missing = [f.name for f in cls.fields.values() if f.required and f.name not in body]
        if missing:
            raise AssertionError(f"{self._where(path)}: {cls.name} requires field(s) "
                                 f"{', '.join(f'`{m}`' for m in missing)}")

    def _check_api_value(self, path: str, where: str, tp, value) -> None:
        """Unknown keys, recursively through nested objects (e.g. /generate's
        `sampling_params`, an object or a list of them)."""
        if isinstance(value, dict):
            struct = _struct_in(tp)
            if struct is None:
                return
            hints = get_type_hints(struct, vars(self.api))
            for key, item in value.items():
                if key not in hints:
                    raise AssertionError(
                        f"{self._where(path)}: field `{key}` in {where} is not one "
                        f"{struct.__name__} reads; fields: {sorted(hints)}")
                self._check_api_value(path, f"{where}.{key}", hints[key], item)
        elif isinstance(value, list):
            elem = _list_elem_in(tp)
            if elem is not None:
                for i, item in enumerate(value):
                    self._check_api_value(path, f"{where}[{i}]", elem, item)

    # -- responses --------------------------------------------------------------------------
    def response_class(self, path: str) -> type:
        if path not in API_TYPES_RESPONSES:
            raise NotImplementedError(f"no response type of {path} is modelled")
        return getattr(self.api, API_TYPES_RESPONSES[path])

    def check_response(self, path: str, body):
        """Decode `body` (parsed JSON) with the release's response type; a list of them for a
        batched /generate. AssertionError if it violates the type."""
        cls = self.response_class(path)
        try:
            if isinstance(body, list) and path == "/generate":
                return [cls.from_json_value(item) for item in body]
            return cls.from_json_value(body)
        except self.api.JsonContractError as e:
            raise AssertionError(f"{self._where(path)} response: {cls.__name__}: {e}") from None

    # -- command line -----------------------------------------------------------------------
    @cached_property
    def _server_flags(self) -> dict[str, ServerFlag]:
        self._check_flag_naming()
        server_args = ast.parse((self.root / SERVER_ARGS).read_text())
        namespaces = _module_assigns(server_args).get("_INPUT_NAMESPACES")
        if not isinstance(namespaces, ast.List):
            raise AssertionError("server_args.py no longer lists _INPUT_NAMESPACES; update "
                                 "tests/contract/stock_sglang.py")
        wanted = {_head(n) for n in namespaces.elts}
        choices_names = _module_assigns(ast.parse((self.root / ARG_CHOICES).read_text()))
        flags: dict[str, ServerFlag] = {}
        found = set()
        for module in sorted((self.root / ARG_FIELDS_DIR).glob("*.py")):
            tree = ast.parse(module.read_text())
            names = {**choices_names, **_module_assigns(tree)}
            for cls in tree.body:
                if isinstance(cls, ast.ClassDef) and cls.name in wanted:
                    found.add(cls.name)
                    for stmt in cls.body:
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                            flags.update((f.flag, f) for f in _flags_of_field(stmt, names))
        if found != wanted:
            raise AssertionError(f"namespace classes not found in arg_groups/fields: "
                                 f"{sorted(wanted - found)}")
        add_cli_args = next(n for n in ast.walk(server_args)
                            if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
        flags.update((f.flag, f) for f in _flags_added_by_hand(add_cli_args))
        flags["--help"] = flags["-h"] = ServerFlag("--help", "help", "none", None)
        return flags

    def _check_flag_naming(self) -> None:
        """The rule this reader applies (`foo_bar` -> `--foo-bar`) is arg_utils.py's."""
        tree = ast.parse((self.root / ARG_UTILS).read_text())
        fn = next((n for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name == "_field_to_cli_name"), None)
        ret = next((s for s in fn.body if isinstance(s, ast.Return)), None) if fn else None
        if ret is None or ast.unparse(ret.value) != "'--' + name.replace('_', '-')":
            raise AssertionError("arg_utils._field_to_cli_name changed: SGLang derives flag "
                                 "names differently; update tests/contract/stock_sglang.py")

    def server_flags(self) -> set[str]:
        """Every option string `python -m sglang.launch_server` accepts."""
        return set(self._server_flags)

    def server_flag(self, flag: str) -> ServerFlag | None:
        return self._server_flags.get(flag)

    def check_server_argv(self, argv: list[str]) -> None:
        """AssertionError listing each problem with a server command line (the part after
        `-m sglang.launch_server`): unknown flags, a value given to a switch or missing after
        a valued flag, a value outside the flag's choices."""
        problems, i = [], 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if not token.startswith("-"):
                problems.append(f"stray argument {token!r}")
                continue
            flag, eq, inline = token.partition("=")
            spec = self._server_flags.get(flag)
            if spec is None:
                problems.append(f"unknown flag {flag}")
                continue
            values = [inline] if eq else []
            if not eq and spec.arity != "none":
                at_most_one = spec.arity in ("one", "?")
                while i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i])
                    i += 1
                    if at_most_one:
                        break
            if spec.arity == "none" and values:
                problems.append(f"{flag} is a switch and takes no value, got {values}")
            elif spec.arity in ("one", "+") and not values:
                problems.append(f"{flag} needs a value")
            if spec.choices is not None:
                allowed = {str(c) for c in spec.choices}
                problems += [f"{flag} {v!r} is not one of {sorted(allowed)}"
                             for v in values if v not in allowed]
        if problems:
            raise AssertionError(f"stock SGLang {self.version} server command line: "
                                 + "; ".join(problems))

    # -- packaging --------------------------------------------------------------------------
    @cached_property
    def requires_dist(self) -> list[str]:
        text = (self.root / METADATA).read_text()
        return [line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("Requires-Dist:")]

    def pinned(self, package: str) -> str | None:
        """The version the release pins `package` to (`name==X` without a marker), if any."""
        norm = re.sub(r"[-_.]+", "-", package).lower()
        for req in self.requires_dist:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?\s*==\s*([^\s;,]+)", req)
            if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == norm:
                return m.group(3)
        return None


def _struct_in(tp) -> type | None:
    """The msgspec Struct a JSON object in a value of type `tp` decodes as, if any."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if get_origin(tp) is Union:
        return next((s for s in map(_struct_in, get_args(tp)) if s is not None), None)
    return None


def _list_elem_in(tp):
    """The element type a JSON array in a value of type `tp` decodes with, if any."""
    if get_origin(tp) is list:
        return get_args(tp)[0] if get_args(tp) else None
    if get_origin(tp) is Union:
        return next((e for e in map(_list_elem_in, get_args(tp)) if e is not None), None)
    return None
