"""Dry-run planning: exact sizes from metadata, validation that names the field, progress."""
import json
import logging
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megarl.backends.megatron.model import ModelArgs
from megarl.convert import plan
from megarl.convert.cli import hf_to_megatron_main, megatron_to_hf_main, reshard_main
from megarl.convert.progress import Progress


def _tensors(model_dir):
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_shapes_and_sizes_match_the_real_hf_files(request, tmp_path, arch):
    src = request.getfixturevalue(f"tiny_{arch}")
    args = ModelArgs.from_hf(json.loads((src / "config.json").read_text()))
    real = _tensors(src)
    assert {k: tuple(v) for k, v in real.items()} == plan.hf_shapes(args)
    p = plan.plan_hf2mcore(src, tmp_path / "out", tp=2, pp=2)
    n = sum(torch.Size(s).numel() for s in real.values())
    assert (p.hf_tensors, p.parameters, p.source_tensor_bytes) == (len(real), n, 4 * n)
    assert p.source_file_bytes == (src / "model.safetensors").stat().st_size
    assert p.padded_vocab == 512  # 300 -> multiple of 128 × TP 2
    # bf16 halves every figure that is in the output dtype
    half = plan.plan_hf2mcore(src, tmp_path / "out", tp=2, pp=2, params_dtype="bfloat16")
    assert 2 * half.output_tensor_bytes == p.output_tensor_bytes
    assert [2 * b for b in half.stage_rank_bytes] == p.stage_rank_bytes
    assert not (tmp_path / "out").exists()


def test_rank_bytes_split_over_tp_and_pp(tiny_qwen2):
    a = ModelArgs.from_hf(json.loads((tiny_qwen2 / "config.json").read_text()))
    one = plan.stage_param_bytes(a, 1, 1, 384, "float32")
    assert one == [plan.mcore_checkpoint_bytes(a, 384, "float32")]
    # TP=2: every matrix halves; the norms (3 per layer pair + final) stay whole on each rank.
    norms = (2 * a.num_layers + 1) * a.hidden_size * 4
    assert plan.stage_param_bytes(a, 2, 1, 384, "float32") == [(one[0] - norms) // 2 + norms]
    # PP=2 with tied embeddings: the last stage holds its own output-layer copy.
    s0, s1 = plan.stage_param_bytes(a, 1, 2, 384, "float32")
    assert s0 + s1 == one[0] + 384 * a.hidden_size * 4


def test_dry_run_prints_json_writes_nothing_and_starts_no_world(tiny_llama, tmp_path, capsys,
                                                                caplog):
    out = tmp_path / "ckpt"
    with caplog.at_level(logging.INFO):
        assert hf_to_megatron_main(["--hf-dir", str(tiny_llama), "--out", str(out), "--tp", "2",
                                    "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 2 and report["max_rank_bytes"] == max(report["stage_rank_bytes"])
    assert report["hf_tensors"] == 21 and report["arch"] == "llama"  # untied: lm_head too
    assert "largest rank" in caplog.text and "output bytes" in caplog.text
    assert not out.exists() and not list(tmp_path.iterdir())
    assert not dist.is_initialized()


def _fake_ckpt(tmp_path, src, **meta):
    ckpt = tmp_path / "ckpt"
    (ckpt / "hf").mkdir(parents=True)
    shutil.copy(src / "config.json", ckpt / "hf" / "config.json")
    (ckpt / "megarl_meta.json").write_text(json.dumps({"tp": 2, "pp": 1, **meta}))
    return ckpt


@pytest.mark.parametrize("main,argv,needle", [
    (hf_to_megatron_main, ["--tp", "3"], "num_attention_heads=4 is not divisible by TP=3"),
    (hf_to_megatron_main, ["--tp", "8"], "num_attention_heads=4 is not divisible by TP=8"),
    (hf_to_megatron_main, ["--pp", "3"], "num_hidden_layers=2 is not divisible by PP=3"),
    (hf_to_megatron_main, ["--tp", "0"], "at least 1"),
    (reshard_main, ["--tp", "3"], "num_attention_heads=4"),
    (reshard_main, [], ".metadata"),
    (megatron_to_hf_main, ["--pp", "4"], "num_hidden_layers=2"),
])
def test_bad_layout_fails_naming_the_field(tiny_qwen2, tmp_path, capsys, main, argv, needle):
    src = ["--hf-dir", str(tiny_qwen2)] if main is hf_to_megatron_main else \
        ["--ckpt", str(_fake_ckpt(tmp_path, tiny_qwen2))]
    out = tmp_path / "out"
    assert main([*src, "--out", str(out), *argv]) == 2  # not a dry run: fails before any work
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_bad_sources_fail_naming_file_and_tensor(tiny_qwen2, tmp_path, capsys):
    def err(main, *argv):
        assert main([*map(str, argv), "--dry-run"]) == 2
        return capsys.readouterr().err

    assert "no such directory" in err(hf_to_megatron_main, "--hf-dir", tmp_path / "x",
                                      "--out", tmp_path / "o")
    assert "megarl_meta.json" in err(reshard_main, "--ckpt", tiny_qwen2, "--out", tmp_path / "o")
    assert "must differ" in err(hf_to_megatron_main, "--hf-dir", tiny_qwen2, "--out", tiny_qwen2)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    assert "architectures" in err(hf_to_megatron_main, "--hf-dir", bad, "--out", tmp_path / "o")
    (bad / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, bad / "model.safetensors")
    assert "model.norm.weight has shape (3,)" in err(hf_to_megatron_main, "--hf-dir", bad,
                                                      "--out", tmp_path / "o")
    tensors["model.norm.weight"] = torch.zeros(64)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    msg = err(hf_to_megatron_main, "--hf-dir", bad, "--out", tmp_path / "o")
    assert "model.layers.1.mlp.up_proj.weight" in msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--ep", "3"], "--ep 3: does not divide num_experts=8 of "),
    (["--ep", "0"], "--ep 0: must be at least 1"),
    (["--ep", "2", "--etp", "3"], "--etp 3: does not divide moe_intermediate_size=32"),
    (["--tp", "2", "--ep", "4"], None),  # 4 × ETP 2 over 8 ranks: a valid layout
])
def test_bad_expert_layout_fails_naming_the_flag(tiny_qwen3_moe, tiny_qwen2, tmp_path, capsys,
                                                 argv, needle):
    out = tmp_path / "out"
    rc = hf_to_megatron_main(["--hf-dir", str(tiny_qwen3_moe), "--out", str(out), *argv,
                              *(["--dry-run"] if needle is None else [])])
    err = capsys.readouterr().err
    assert (rc, needle in err if needle else "error" not in err) == (0 if needle is None else 2,
                                                                      True), err
    assert not out.exists() and not dist.is_initialized()
    # A dense model refuses expert parallelism, for all three converters alike.
    for main, src in ((hf_to_megatron_main, ["--hf-dir", str(tiny_qwen2)]),
                      (reshard_main, ["--ckpt", str(_fake_ckpt(tmp_path, tiny_qwen2))])):
        assert main([*src, "--out", str(out), "--ep", "2"]) == 2
        assert "--ep 2: expert parallelism needs a mixture-of-experts model" in \
            capsys.readouterr().err


def test_expert_parallel_plan_splits_experts_and_sizes_the_world(tiny_qwen3_moe, tmp_path,
                                                                   capsys):
    """Each EP rank holds num_experts / EP experts, each split over ETP; the world is
    PP × lcm(TP, EP × ETP) ranks, its extra ranks data-parallel replicas of the dense layers."""
    a = ModelArgs.from_hf(json.loads((tiny_qwen3_moe / "config.json").read_text()))
    per_expert = 3 * a.moe_ffn_hidden_size * a.hidden_size  # gate, up, down
    experts = a.num_layers * a.num_experts * per_expert
    (dense, whole), = plan.stage_param_counts(a, 1, 1, 384)
    assert whole == experts
    assert plan.stage_param_counts(a, 1, 1, 384, ep=2) == [(dense, experts // 2)]
    assert plan.stage_param_counts(a, 2, 1, 512, ep=4)[0][1] == experts // 8  # ETP = TP
    assert plan.stage_param_counts(a, 2, 1, 512, ep=4, etp=1)[0][1] == experts // 4
    assert [plan.world_size(*x) for x in ((2, 1), (2, 1, 2), (2, 1, 2, 1), (2, 2, 4, 1),
                                          (1, 1, 8, 1), (4, 1, 8, 1))] == [2, 4, 2, 8, 8, 8]
    assert hf_to_megatron_main(["--hf-dir", str(tiny_qwen3_moe), "--out", str(tmp_path / "o"),
                                "--tp", "2", "--ep", "4", "--etp", "1", "--dry-run",
                                "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["ep"], report["etp"], report["ranks"]) == (4, 1, 4)
    one = plan.plan_hf2mcore(tiny_qwen3_moe, tmp_path / "o", tp=2)
    # fp32 experts: a half of them per TP2 rank, a quarter per EP4 rank
    assert one.max_rank_bytes - report["max_rank_bytes"] == 4 * experts // 2 - 4 * experts // 4
    assert "TP=2 PP=1 EP=4 ETP=1 (4 ranks, 2 data-parallel replicas of the dense layers)" in \
        plan.plan_hf2mcore(tiny_qwen3_moe, tmp_path / "o", tp=2, ep=4, etp=1).table()


def test_progress_logs_every_tenth_off_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="megarl.convert.progress"):
        with Progress("copy", 40, 40 * 1024) as p:
            assert p.mode == "log"  # pytest's stderr is not a TTY
            for _ in range(40):
                p.update(1024)
    lines = [r.getMessage() for r in caplog.records]
    assert [ln.split(": ")[1].split("%")[0] for ln in lines] == [str(10 * i) for i in
                                                                range(1, 11)]
    assert lines[-1] == "copy: 100% (40/40 tensors, 40.0 KiB/40.0 KiB)"


def test_progress_bar_when_asked_and_silent_off_rank0(capsys, caplog, monkeypatch):
    with Progress("copy", 2, 2048, bar=True) as p:
        p.update(1024)
        p.update(1024)
    assert "copy" in capsys.readouterr().err and not caplog.records
    monkeypatch.setenv("RANK", "1")
    with Progress("copy", 1, 10, bar=True) as p:
        p.update(10)
    assert p.mode is None and not capsys.readouterr().err and not caplog.records


def test_megarl_convert_lists_every_subcommand(capsys):
    from megarl.cli import main

    assert main(["convert"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("hf2mcore", "mcore2hf", "reshard"))
    with pytest.raises(SystemExit) as done:
        main(["convert", "--help"])
    assert done.value.code == 0 and "hf2mcore,mcore2hf,reshard" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["convert", "reshard", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--dry-run" in out and "Optimizer state is dropped" in out
