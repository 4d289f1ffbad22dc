"""A Hugging Face model's config.json, read into `ModelArgs`, and the TP×PP layout rule.

`check_layout` is the one rule set for splitting a model over TP×PP. The converter, the
Megatron worker and the train preflight all call it, so each refuses the same layouts with
the same words. Uneven pipeline stages are refused (Megatron would need per-stage layer
counts that megarl neither sets nor maps); fewer KV heads than TP ranks is accepted when TP
is a multiple of them, because Megatron then replicates each KV head over TP/kv ranks and the
fused QKV tensor still splits into equal row blocks, which is all the converter's mapping
assumes.

It lives with the Megatron backend (which reads a model directory when a worker starts) and
`megarl.convert.inputs` re-exports it with the converter's other input checks.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megarl.backends.megatron.model import ModelArgs


class ConvertError(ValueError):
    """Bad input to a conversion (message names the flag, file, field or tensor)."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def read_json(path: Path) -> Any:
    """Parse a JSON file; any read, decode or syntax problem names the file."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConvertError(f"{path}: cannot be read ({err.strerror or _one_line(err)})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConvertError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ConvertError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} "
                           f"column {err.colno})") from None
    except RecursionError:
        raise ConvertError(f"{path}: JSON nested too deeply") from None


# ------------------------------------------------------------------------- config.json
# field -> (required, kind); kinds: "int" positive integer, "float" positive finite number,
# "bool" a JSON boolean. Booleans are not accepted as integers (JSON true is not 1 here).
_FIELDS = {
    "vocab_size": (True, "int"), "hidden_size": (True, "int"),
    "num_hidden_layers": (True, "int"), "num_attention_heads": (True, "int"),
    "intermediate_size": (True, "int"), "num_key_value_heads": (False, "int"),
    "head_dim": (False, "int"), "max_position_embeddings": (False, "int"),
    "rms_norm_eps": (False, "float"), "rope_theta": (False, "float"),
    "tie_word_embeddings": (False, "bool"), "attention_bias": (False, "bool"),
    "use_sliding_window": (False, "bool"),
    # Qwen3-MoE (read by ModelArgs.from_hf for that architecture)
    "num_experts": (False, "int"), "num_local_experts": (False, "int"),
    "num_experts_per_tok": (False, "int"),
    "moe_intermediate_size": (False, "int"), "norm_topk_prob": (False, "bool"),
    "decoder_sparse_step": (False, "int"),
    # GLM-4.5 (and the DeepSeek-V3 family's routing keys)
    "n_routed_experts": (False, "int"), "n_group": (False, "int"), "topk_group": (False, "int"),
    "routed_scaling_factor": (False, "float"), "use_qk_norm": (False, "bool"),
    # DeepSeek-V3 / Kimi-K2 multi-latent attention (q_lora_rank may be null: no query latent)
    "kv_lora_rank": (False, "int"), "q_lora_rank": (False, "int"),
    "qk_nope_head_dim": (False, "int"), "qk_rope_head_dim": (False, "int"),
    "v_head_dim": (False, "int"),
}


def _field_problem(value: Any, kind: str) -> str | None:
    if kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return None if ok else "must be a positive integer"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0
    return None if ok else "must be a positive finite number"


def model_args(hf: Any, where: str) -> ModelArgs:
    """`ModelArgs` from a parsed config.json, every field it uses checked first."""
    if not isinstance(hf, dict):
        raise ConvertError(f"{where}: must be a JSON object, got {type(hf).__name__}")
    for field, (required, kind) in _FIELDS.items():
        value = hf.get(field)
        if value is None:
            if required:
                raise ConvertError(f"{where}: missing field {field!r}")
            continue
        problem = _field_problem(value, kind)
        if problem:
            raise ConvertError(f"{where}: {field}={value!r} {problem}")
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"{where}: architectures={archs!r} must be a list of names")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConvertError(f"{where}: {key}={hf[key]!r} must be an object or null")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or \
        hf["num_attention_heads"]
    if heads % kv:
        raise ConvertError(f"{where}: num_attention_heads={heads} is not a multiple of "
                           f"num_key_value_heads={kv}")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        raise ConvertError(f"{where}: hidden_size={hf['hidden_size']} is not divisible by "
                           f"num_attention_heads={heads} (and there is no head_dim)")
    try:
        return ModelArgs.from_hf(hf)
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{where}: {str(err).removeprefix('config.json ')}") from None


def read_model_args(model_dir: str | os.PathLike, what: str = "model directory") -> ModelArgs:
    """Parse and check `model_dir`/config.json."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConvertError(f"{what} {model_dir}: no such directory (config.json expected)")
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise ConvertError(f"{what} {model_dir}: no config.json")
    return model_args(read_json(cfg), str(cfg))


# ------------------------------------------------------------------------- TP × PP layout
def layout_error(a: ModelArgs, tp: int, pp: int, ep: int = 1,
                 etp: int | None = None) -> str | None:
    """Why `a` cannot be split over TP×PP ranks, its experts over EP ranks with each expert
    over ETP ranks (None: TP), or None when it can (Megatron's rules)."""
    etp = tp if etp is None else etp
    if tp < 1 or pp < 1 or ep < 1 or etp < 1:
        return f"TP={tp} PP={pp} EP={ep} ETP={etp}: each must be at least 1"
    if (ep > 1 or etp != tp) and not a.is_moe:
        return (f"EP={ep} ETP={etp}: expert parallelism needs a mixture-of-experts model "
                f"(num_experts), this one is dense")
    if a.is_moe and a.num_experts % ep:
        return f"num_experts={a.num_experts} is not divisible by EP={ep}"
    if a.num_heads % tp:
        return f"num_attention_heads={a.num_heads} is not divisible by TP={tp}"
    if a.is_mla:
        # the local spec's MLA splits its down-projections' outputs over TP (all-gathered
        # before the latent norms), so the latents must split evenly
        if a.q_lora_rank % tp:
            return f"q_lora_rank={a.q_lora_rank} is not divisible by TP={tp}"
        if (a.kv_lora_rank + a.qk_rope_head_dim) % tp:
            return (f"kv_lora_rank + qk_rope_head_dim = {a.kv_lora_rank} + "
                    f"{a.qk_rope_head_dim} is not divisible by TP={tp}")
    elif a.num_kv_heads % tp and tp % a.num_kv_heads:
        return (f"num_key_value_heads={a.num_kv_heads} is neither a multiple nor a divisor of "
                f"TP={tp}")
    qkv_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    if not a.is_mla and qkv_rows % tp:
        return (f"the fused QKV projection ((num_attention_heads + 2 × num_key_value_heads) × "
                f"head_dim = {qkv_rows} rows) is not divisible by TP={tp}")
    if a.is_moe and a.moe_ffn_hidden_size % etp:
        return (f"moe_intermediate_size={a.moe_ffn_hidden_size} is not divisible by "
                f"{'TP' if etp == tp else 'ETP'}={etp}")
    if (not a.is_moe or a.first_k_dense) and a.ffn_hidden_size % tp:
        return f"intermediate_size={a.ffn_hidden_size} is not divisible by TP={tp}"
    if a.moe_shared_ffn_hidden_size % tp:
        return (f"the shared experts' width (moe_intermediate_size × n_shared_experts = "
                f"{a.moe_shared_ffn_hidden_size}) is not divisible by TP={tp}")
    if a.num_layers % pp:
        return (f"num_hidden_layers={a.num_layers} is not divisible by PP={pp} (every pipeline "
                f"stage holds the same number of layers; uneven stages are not supported)")
    return None


def check_layout(a: ModelArgs, tp: int, pp: int, where: str = "config.json", ep: int = 1,
                 etp: int | None = None) -> None:
    """Raise ConvertError naming `where` (the config.json) unless `a` splits over TP×PP
    (and its experts over EP×ETP)."""
    problem = layout_error(a, tp, pp, ep, etp)
    if problem:
        raise ConvertError(f"{where}: {problem}")
