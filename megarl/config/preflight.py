"""Checks of what a run reads and writes on disk, made before Ray or any worker starts.

``preflight(cfg)`` runs in ``megarl train`` / ``megarl validate`` right after the config is
loaded, on every rank under torchrun (so no rank waits in a rendezvous for one that has
already failed). It owns the file half of "bad input fails early": the output directory, the
resume checkpoint's presence, the model directory's presence, the tokenizer and the data
files; and the one machine fact, that a cuda node has the GPUs the run asks for. Every failure
is a ``ConfigError`` whose one line names the key and the file (and row).

The model directory's contents and the TP/PP layout against it are checked with
``megarl.convert.inputs``, the converter's and the Megatron worker's own checks. Left to
others: value types and ranges (``validate.py``), checkpoint integrity. Assets a
run makes itself when absent (the quickstart's tiny model and synthetic task, see
``megarl.controller.setup.prepare_assets``) are not read here; only their directory must be
writable.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from megarl.config.device import check_node_devices
from megarl.config.errors import ConfigError
from megarl.config.schema import MEGATRON_SECTIONS

logger = logging.getLogger(__name__)

_MODEL = "actor_rollout_ref.model"
# Any one of these makes a directory look like a saved tokenizer to transformers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "spiece.model")


def preflight(cfg, cuda_devices: int | None = None) -> None:
    """Raise ``ConfigError`` for the first missing, unreadable or malformed input or
    unwritable output of the run ``cfg`` describes, or a node with fewer GPUs than it asks
    for (``cuda_devices``; None: as many as torch sees); starts nothing."""
    t = cfg.trainer
    check_node_devices(cfg, cuda_devices)
    _check_planning_only(cfg)
    _check_path_texts(cfg)
    _check_writable_dir(Path(t.default_local_dir) / t.project_name / t.experiment_name,
                        "trainer.default_local_dir")
    _check_resume(cfg)
    _check_transformer_engine(cfg)
    _check_sglang_server(cfg)
    model_dir = _check_model_dir(cfg)
    tokenizer_dir = _check_tokenizer_dir(cfg)
    # Cheapest first: the rows need neither torch (the model files' checks) nor transformers
    # (the tokenizer), whose imports take seconds.
    sources = _check_data(cfg, None)
    why = _runs_model_code(cfg, sources)
    if why:
        _check_sandbox(cfg, why)
    if model_dir is not None:
        _check_model_files(cfg, model_dir)
    tokenizer = _load_tokenizer(cfg, tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer is not None and _lengths_can_fail(cfg.data):
        _check_data(cfg, tokenizer)


def _check_planning_only(cfg) -> None:
    """Keys only ``--dry-run`` reads: a run builds every model (Megatron's, the engines') from
    the model directory's own config.json, so there they would change nothing."""
    model = cfg.actor_rollout_ref.model
    if model.override_config:
        raise ConfigError(
            f"{_MODEL}.override_config: applied only when planning (megarl train --dry-run); "
            f"a run builds the model from {model.path}/config.json as it is, so these keys "
            f"({', '.join(sorted(map(str, model.override_config)))}) would change nothing. "
            f"Edit that file (a copy of the model directory) to run a different model")
    if model.hf_config_path is not None:
        raise ConfigError(
            f"{_MODEL}.hf_config_path: read only when planning (megarl train --dry-run); a run "
            f"reads {model.path}/config.json. Give it on the --dry-run command line only")


def _check_sglang_server(cfg) -> None:
    """Launched stock SGLang servers need a Python with sglang: named by
    `rollout.server_python`, or the CPU environment tools/setup_sglang_env.sh builds, or
    megarl's own (a GPU install). Checked here, not after minutes of start-up. Servers the
    user runs (`server_urls`) must answer, with the configured TP."""
    import importlib.util

    r = cfg.actor_rollout_ref.rollout
    if r.name == "sglang" and r.server_urls:
        check_user_servers(list(r.server_urls), r.tensor_model_parallel_size)
    if r.name != "sglang" or r.server_urls or r.server_module:
        return
    from megarl.backends.sglang import cpu_env

    key = "actor_rollout_ref.rollout.server_python"
    if r.get("server_python"):
        if not Path(r.server_python).exists():
            raise ConfigError(f"{key}: {r.server_python} does not exist")
        return
    if os.environ.get("MEGARL_SGLANG_PYTHON") or cpu_env.venv_status() is None:
        return
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"actor_rollout_ref.rollout.name=sglang launches stock SGLang "
                          f"servers, but this Python has no sglang and {key} is null: "
                          f"{cpu_env.venv_status()} (GPU machines: pip install -e .[gpu])")


def check_user_servers(urls: list[str], tp: int, timeout_s: float = 30.0) -> None:
    """Servers the user runs must have the TP the config gives them (the update group's ranks
    are counted from it): read from each server's `/server_info` before any work starts."""
    import json
    import urllib.request

    from megarl.rollout.auth import headers

    key = "actor_rollout_ref.rollout"
    for i, url in enumerate(urls):
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    url.rstrip("/") + "/server_info", headers=headers()),
                    timeout=timeout_s) as resp:
                info = json.loads(resp.read())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.server_urls[{i}]: {url} does not answer /server_info "
                              f"({e})") from None
        have = info.get("tp_size")
        if have is not None and int(have) != tp:
            raise ConfigError(f"{key}.tensor_model_parallel_size is {tp}, but "
                              f"{key}.server_urls[{i}] ({url}) runs with tp_size {have}")


def _check_transformer_engine(cfg) -> None:
    """`transformer_impl: transformer_engine` needs the package (an optional GPU extra)."""
    import importlib.util

    for key in MEGATRON_SECTIONS:
        if OmegaConf.select(cfg, f"{key}.transformer_impl") == "transformer_engine" and \
                importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(f"{key}.transformer_impl: transformer_engine, but Transformer "
                              "Engine is not installed (docs/install_gpu.md; or use auto)")


def _check_path_texts(cfg) -> None:
    """Refuse, by key, a path holding a NUL byte: every file call on it raises ValueError."""
    t, model, d = cfg.trainer, cfg.actor_rollout_ref.model, cfg.data
    values = [("trainer.default_local_dir", t.default_local_dir),
              ("trainer.project_name", t.project_name),
              ("trainer.experiment_name", t.experiment_name),
              ("trainer.resume_from_path", t.resume_from_path),
              (f"{_MODEL}.path", model.path), (f"{_MODEL}.tokenizer_path", model.tokenizer_path)]
    for key in ("train_files", "val_files"):
        files = d[key]
        for f in files if isinstance(files, (list, ListConfig)) else [files]:
            values.append((f"data.{key}", f))
    for key, value in values:
        if isinstance(value, str) and "\x00" in value:
            raise ConfigError(f"{key}: {value!r} is not a usable path (it holds a NUL byte)")


def _check_writable_dir(path: Path, key: str) -> None:
    """Create ``path`` (as the run would) and prove it writable with a temp file."""
    # The nearest existing ancestor says why a mkdir would fail better than errno does.
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise ConfigError(f"{key}: cannot use {path}: {ancestor} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".megarl-preflight-", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise ConfigError(f"{key}: {path} is not a writable directory "
                          f"({err.strerror or type(err).__name__})") from None


def _check_resume(cfg) -> None:
    """The checkpoint that ``resume_mode=resume_path`` names exists and is a megarl step
    directory. (Whether its files are intact is the checkpoint module's to verify.)"""
    t = cfg.trainer
    if t.resume_mode != "resume_path":
        return
    key, d = "trainer.resume_from_path", Path(t.resume_from_path)
    if not d.exists():
        raise ConfigError(f"{key}: no such checkpoint directory: {d}")
    if not d.is_dir():
        raise ConfigError(f"{key}: {d} is a file; give a checkpoint directory "
                          f"(<default_local_dir>/<project>/<experiment>/global_step_<k>)")
    state = d / "driver_state.json"
    if not state.is_file():
        raise ConfigError(f"{key}: {d} has no driver_state.json, so it is not a megarl "
                          f"checkpoint (<default_local_dir>/<project>/<experiment>/"
                          f"global_step_<k>)")
    try:
        data = json.loads(state.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ConfigError(f"{key}: {state}: not readable JSON "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                          ) from None
    if not isinstance(data, dict) or type(data.get("step")) is not int:
        raise ConfigError(f"{key}: {state}: expected an object with an integer `step`")


def _made_by_run(model) -> bool:
    """True when the run will make the tiny model at ``model.path`` itself."""
    return bool(model.make_tiny) and not (Path(model.path) / "config.json").is_file()


def _check_model_dir(cfg) -> Path | None:
    """The model directory is there; None when the run makes it (its parent is writable)."""
    model = cfg.actor_rollout_ref.model
    path = Path(model.path)
    if _made_by_run(model):
        _check_writable_dir(path.parent, f"{_MODEL}.path")
        return None
    if not path.exists():
        raise ConfigError(f"{_MODEL}.path: no such model directory: {path} (set {_MODEL}."
                          f"make_tiny to make a tiny one)")
    if not path.is_dir():
        raise ConfigError(f"{_MODEL}.path: {path} is a file, not a model directory")
    return path


def _check_model(cfg) -> None:
    """The model directory and its files, as the run will use them."""
    path = _check_model_dir(cfg)
    if path is not None:
        _check_model_files(cfg, path)


def _check_model_files(cfg, path: Path) -> None:
    """config.json, every weight file's header and the TP/PP layouts of the Megatron models,
    with the checks and words of the converter and the Megatron worker (convert/inputs.py)."""
    from megarl.backends.megatron.model import vpp_error
    from megarl.convert.inputs import ConvertError, check_hf_dir, layout_error

    arr = cfg.actor_rollout_ref
    try:
        args, _ = check_hf_dir(path)
    except ConvertError as err:
        raise ConfigError(f"{_MODEL}.path: {err}") from None
    layouts = [("actor_rollout_ref.actor.megatron", arr.actor.megatron)]
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:  # the run builds a ref model
        layouts.append(("actor_rollout_ref.ref.megatron", arr.ref.megatron))
    from megarl.config.validate import plan_task_groups

    if not any({"logp", "actor-train"} <= set(g.tasks) for g in plan_task_groups(cfg)):
        layouts.append(("actor_rollout_ref.logp", arr.logp))  # the replica's own layout
    for prefix, m in layouts:
        # a logp replica runs the actor's expert layout
        experts = arr.actor.megatron if prefix == "actor_rollout_ref.logp" else m
        ep, etp = experts.expert_model_parallel_size, experts.expert_tensor_parallel_size
        problem = layout_error(args, m.tensor_model_parallel_size,
                               m.pipeline_model_parallel_size, ep, etp)
        if problem:
            ekey = "actor_rollout_ref.actor.megatron" if experts is not m else prefix
            knob = (f"{ekey}.expert_tensor_parallel_size" if "ETP=" in problem and "EP=" not in
                    problem.replace("ETP=", "") else
                    f"{ekey}.expert_model_parallel_size" if "EP=" in problem else
                    f"{prefix}.tensor_model_parallel_size" if "TP=" in problem else
                    f"{prefix}.pipeline_model_parallel_size")
            raise ConfigError(f"{knob}: {path / 'config.json'}: {problem}")
        vpp = getattr(m, "virtual_pipeline_model_parallel_size", None)
        problem = vpp_error(args.num_layers, m.pipeline_model_parallel_size, vpp,
                            int(getattr(m, "context_parallel_size", 1) or 1))
        if problem:
            raise ConfigError(f"{prefix}.virtual_pipeline_model_parallel_size={vpp}: "
                              f"{path / 'config.json'}: {problem}")
    trained = [("actor_rollout_ref.actor.megatron", arr.actor.megatron)]
    if cfg.algorithm.adv_estimator == "gae":
        trained.append(("critic.megatron", cfg.critic.megatron))
    for prefix, m in trained:
        if args.is_moe and m.tensor_model_parallel_size > 1 and not m.sequence_parallel:
            # megatron-core 0.16's MoE layer trains under TP only with sequence parallelism
            raise ConfigError(f"{prefix}.sequence_parallel: false, but training a mixture of "
                              f"experts at {prefix}.tensor_model_parallel_size="
                              f"{m.tensor_model_parallel_size} needs sequence parallelism "
                              f"(megatron-core 0.16's MoE layer); set it true, or use TP=1 "
                              f"with {prefix}.expert_model_parallel_size (TP>1 without it is "
                              f"fine for the reference and a logp replica)")
    for key, on in (("actor_rollout_ref.rollout.enable_rollout_routing_replay",
                     arr.rollout.enable_rollout_routing_replay),
                    ("actor_rollout_ref.actor.router_replay.mode",
                     arr.actor.router_replay.mode != "disabled")):
        if on and not args.is_moe:
            raise ConfigError(f"{key}: routing replay needs a mixture-of-experts model, but "
                              f"{path / 'config.json'} is a dense {args.arch}")


def _tokenizer_key(model) -> str:
    return f"{_MODEL}.tokenizer_path" if model.tokenizer_path is not None else f"{_MODEL}.path"


def _check_tokenizer_dir(cfg) -> Path | None:
    """The tokenizer directory, if it holds a tokenizer; None when the run makes it."""
    model = cfg.actor_rollout_ref.model
    if model.tokenizer_path is None and _made_by_run(model):
        return None
    key = _tokenizer_key(model)
    path = Path(model.tokenizer_path or model.path)
    if not path.exists():
        raise ConfigError(f"{key}: no such tokenizer directory: {path}")
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a tokenizer directory")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"{key}: {path} holds no tokenizer (none of "
                          f"{', '.join(_TOKENIZER_FILES)})")
    return path


def _load_tokenizer(cfg, path: Path):
    """Load the tokenizer as the run will. Loading, not just looking for its files, is what
    finds a corrupt ``tokenizer.json``; the run imports transformers anyway, so the cost here
    is one small file read."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    try:
        return AutoTokenizer.from_pretrained(str(path),
                                             trust_remote_code=model.trust_remote_code)
    except Exception as err:  # transformers raises many kinds for a broken tokenizer
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ConfigError(f"{_tokenizer_key(model)}: {path}: cannot load the tokenizer "
                          f"({type(err).__name__}: {reason})") from None


def _lengths_can_fail(d) -> bool:
    """Only this setting makes a prompt's length an error (else long prompts are dropped or
    cut), and only the tokenizer can tell a length."""
    return not d.filter_overlong_prompts and d.truncation == "error"


def _runs_model_code(cfg, sources: dict[str, str]) -> str:
    """What in this run executes model-written programs ('' if nothing megarl knows of)."""
    from megarl.reward import code_exec
    from megarl.reward.registry import builtin_for

    if cfg.reward.reward_fn is None:
        for source, where in sources.items():
            if builtin_for(source) is code_exec.compute_score:
                return f"data_source {source!r} ({where}) is scored by running its code"
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.enable and any(t == "python" for t in mt.tools):
        return "actor_rollout_ref.rollout.multi_turn.tools has the python tool"
    return ""


def _check_sandbox(cfg, why: str) -> None:
    """A run that executes model code needs the sandbox whole (or the user's word that a weaker
    one will do): found out now, not at the first code reward with the workers up."""
    from megarl.reward import sandbox

    sb = cfg.reward.sandbox
    sandbox.configure(float(sb.max_time_limit_s), int(sb.max_memory_limit_mb),
                      bool(sb.allow_unhardened))
    try:
        weak = sandbox.check()
    except sandbox.SandboxUnavailableError as err:
        raise ConfigError(f"reward.sandbox: {why}, and the code sandbox cannot run here: {err}. "
                          f"See docs/security.md") from None
    if weak:
        logger.warning("reward.sandbox.allow_unhardened: %s; model code runs without %s",
                       why, ", ".join(weak))


def _check_data_sources(split: str, sources: dict[str, str]) -> None:
    """With no ``reward.reward_fn``, every row's ``data_source`` has a built-in scorer: one
    without would score ``failure_score`` on every sample, and the run would train on it."""
    from megarl.reward.registry import builtin_for, no_builtin_message

    for source, where in sources.items():
        if builtin_for(source) is None:
            raise ConfigError(f"data.{split}_files: {where}: {no_builtin_message(source)}")


def _check_data(cfg, tokenizer) -> dict[str, str]:
    """Read every row of the train and val files (the run loads both, even to validate);
    with a tokenizer, tokenize them too.

    Tokenizing here means the files are tokenized again when the run loads them, so it is
    done only when lengths can fail. A full pass over local files is cheap at the sizes megarl
    loads into memory, and failing now beats failing after the workers are up. Returns the
    rows' data sources, each with where it was first seen (without a tokenizer).
    """
    from megarl.data.dataset import load_split, scan_split

    d = cfg.data
    made = [f for f in (d.train_files, d.val_files) if isinstance(f, str)]
    if d.synthetic_task and not all(Path(f).exists() for f in made):
        # The run writes the synthetic task to train_files and val_files before it loads
        # it. (Under torchrun, rank 0 may be writing it now: train, then val, each renamed
        # into place, so "not both there yet" is the state to leave alone.)
        _check_writable_dir(Path(str(d.train_files)).parent, "data.train_files")
        return {}
    all_sources: dict[str, str] = {}
    for split in ("train", "val"):
        if tokenizer is not None:
            ds = load_split(d, tokenizer, split)
            n = 0 if ds is None else len(ds)
        else:
            sources: dict[str, str] = {}
            n = scan_split(d, split, sources)
            if cfg.reward.reward_fn is None:
                _check_data_sources(split, sources)
            all_sources.update({k: f"data.{split}_files: {v}" for k, v in sources.items()})
        if split == "train" and n < d.train_batch_size:
            raise ConfigError(f"data.train_batch_size: {d.train_batch_size} is larger than the "
                              f"{n} usable prompt(s) in data.train_files, so no full batch "
                              f"exists")
    return all_sources
