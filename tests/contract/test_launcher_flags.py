"""The launcher's command line is one stock `python -m sglang.launch_server` accepts: every flag
`build_command` can emit exists in the pinned release, switches get no value, valued flags get
one, and values with stated choices are among them.

Every optional `ServerArgs` field is set (iterating over the dataclass, so fields added later
are covered without editing this test)."""
from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from megarl.backends.sglang.launcher import ServerArgs, build_command

MODULE = "sglang.launch_server"


def _sample(field: dataclasses.Field, tp, stock) -> object:
    """A value for an optional field: the flag's first choice where the release states them."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
    spec = stock.server_flag("--" + field.name.replace("_", "-"))
    if spec is not None and spec.choices:
        return spec.choices[0]
    samples = {bool: True, int: 1, float: 0.5, str: "x"}
    if base not in samples:
        pytest.fail(f"ServerArgs.{field.name}: no sample value for {tp}; extend _sample")
    return samples[base]


def _every_optional_set(stock) -> ServerArgs:
    hints = typing.get_type_hints(ServerArgs)
    kwargs = {}
    for field in dataclasses.fields(ServerArgs):
        if field.name in ("model_path", "extra_args"):  # required; user-supplied passthrough
            continue
        if field.default is None:
            kwargs[field.name] = _sample(field, hints[field.name], stock)
        elif field.default is False:  # an opt-in switch
            kwargs[field.name] = True
    return ServerArgs(model_path="m", **kwargs)


def _cases(stock) -> dict[str, ServerArgs]:
    return {
        "defaults": ServerArgs(model_path="m"),
        "every optional field set": _every_optional_set(stock),
        "as rollout replicas start (dummy weights, no tokenizer)": ServerArgs(
            model_path="m", load_format="dummy", skip_tokenizer_init=True, base_gpu_id=2,
            nccl_port=29600, tp_size=2, mem_fraction_static=0.6),
        "tokenizer on": ServerArgs(model_path="m", skip_tokenizer_init=False),
        # every value of rollout.dtype but auto (which megarl resolves itself)
        **{f"dtype {d}": ServerArgs(model_path="m", dtype=d)
           for d in ("float32", "bfloat16", "float16")},
        # How docs/install_gpu.md says to make `sampling_seed` take effect.
        "server_extra_args": ServerArgs(model_path="m",
                                        extra_args=["--enable-deterministic-inference"]),
    }


def _server_argv(cmd: list[str]) -> list[str]:
    assert cmd[1:3] == ["-m", MODULE], cmd
    return cmd[3:]


def test_every_emitted_flag_is_one_stock_sglang_accepts(stock_sglang):
    accepted = stock_sglang.server_flags()
    for name, args in _cases(stock_sglang).items():
        argv = _server_argv(build_command(args, module=MODULE))
        flags = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        unknown = sorted(flags - accepted)
        assert not unknown, (f"{name}: stock SGLang {stock_sglang.version} has no flag "
                             f"{unknown}; command: {argv}")


def test_flag_values_fit_the_stock_parser(stock_sglang):
    for name, args in _cases(stock_sglang).items():
        argv = _server_argv(build_command(args, module=MODULE))
        try:
            stock_sglang.check_server_argv(argv)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}; command: {argv}") from None


def test_every_optional_field_is_set(stock_sglang):
    """The sweep above really sets every field ServerArgs declares optional."""
    args = _every_optional_set(stock_sglang)
    unset = [f.name for f in dataclasses.fields(ServerArgs)
             if f.default is None and getattr(args, f.name) is None]
    assert not unset
    assert args.model_path == "m"
