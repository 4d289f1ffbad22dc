"""Make a tiny Hugging Face-format causal LM directory locally (random weights, real tokenizer).

Nothing can be downloaded from a model hub on the machines this project is developed and
tested on, so tests, benchmarks and the quickstart build their own model: a Llama- or
Qwen2- or Qwen3-shaped config, random weights saved as safetensors, and a byte-level BPE tokenizer
trained here with `tokenizers` on a small synthetic corpus (arithmetic and short words), saved
as tokenizer.json with a chat template. Deliberately simplified: the tokenizer corpus is tiny,
so it is only good for the synthetic tasks that the project generates itself.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Qwen2.5's tool-use markers, special tokens there too; added (after the BPE vocabulary, so a
# model made without them is unchanged) when the tiny model is made for a multi-turn run.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2-style chat template; kept short so the tiny tokenizer stays readable in tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")


def _corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    words = ["the", "answer", "is", "what", "plus", "minus", "times", "equals", "question",
             "user", "assistant", "system", "think", "step", "so", "number", "sum", "of", "and"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        out.append(f"What is {a} {op} {b}? " + " ".join(rng.choices(words, k=6)) + f" {a}{op}{b}")
    return out


def build_tokenizer(vocab_size: int, seed: int = 0):
    """Train a byte-level BPE tokenizer; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    return tok


def hf_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
              num_kv_heads: int, intermediate_size: int, tie_word_embeddings: bool,
              rope_theta: float, max_position_embeddings: int, eos_token_id: int,
              pad_token_id: int, head_dim: int | None = None,
              rope_scaling: dict | None = None):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
        bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        torch_dtype="float32",
    )
    if rope_scaling:  # e.g. Llama 3.x's {"rope_type": "llama3", "factor": 32.0, ...}
        common["rope_scaling"] = dict(rope_scaling)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False,
                           head_dim=head_dim or hidden_size // num_heads, **common)
    if arch == "qwen3":
        return Qwen3Config(attention_bias=False, head_dim=head_dim or hidden_size // num_heads,
                           **common)
    if arch == "qwen3_moe":
        # every layer a mixture: 8 experts of a quarter width, top-2, renormalised (as the
        # released Qwen3-MoE configs: norm_topk_prob true, decoder_sparse_step 1)
        return Qwen3MoeConfig(attention_bias=False,
                              head_dim=head_dim or hidden_size // num_heads, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              **common)
    if arch == "glm4_moe":
        # GLM-4.5's layout: partial rotary 0.5, QKV bias, the first layer dense, 8 routed
        # experts (top-2, sigmoid, correction bias, renormalised, scaled) and one shared;
        # QK-norm on (GLM-4.5-Air/355B ship it off; on here so its mapping is tested too)
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta,
                                     "partial_rotary_factor": 0.5}
        common.pop("rope_theta")
        return Glm4MoeConfig(attention_bias=True, head_dim=head_dim or hidden_size // num_heads,
                             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                             moe_intermediate_size=intermediate_size // 4, norm_topk_prob=True,
                             n_group=1, topk_group=1, routed_scaling_factor=2.5,
                             first_k_dense_replace=1, use_qk_norm=True,
                             num_nextn_predict_layers=0, **common)
    if arch == "deepseek_v3":
        # DeepSeek-V3's layout at a small size: multi-latent attention (query and key/value
        # latents, a RoPE key shared by the heads), YaRN with the released mscale settings,
        # the first layer dense, 8 routed experts in 2 groups (one group chosen per token,
        # top-2 within it: num_experts_per_tok / topk_group = 2 as in the released 8 / 4),
        # sigmoid with correction bias, renormalised and scaled, one shared expert
        common["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": rope_theta, "factor": 4.0,
            "original_max_position_embeddings": max_position_embeddings // 4,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        common.pop("rope_theta")
        common["num_key_value_heads"] = num_heads
        cfg = DeepseekV3Config(q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 2,
                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=intermediate_size // 4,
                                norm_topk_prob=True, n_group=2, topk_group=1,
                                routed_scaling_factor=2.5, first_k_dense_replace=1,
                                rope_interleave=True, attention_bias=False,
                                num_mtp_layers=0, **common)
        # keys of the released config.json that transformers does not read and stock
        # SGLang's loader does (moe_layer_freq: every layer past the dense ones an MoE)
        for key, value in (("moe_layer_freq", 1), ("topk_method", "noaux_tc"),
                           ("scoring_func", "sigmoid"), ("ep_size", 1)):
            setattr(cfg, key, value)
        return cfg
    raise ValueError(f"arch: unknown architecture {arch!r}; expected one of {ARCHS}")


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen2", *, vocab_size: int = 300,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 128,
                    tie_word_embeddings: bool | None = None, rope_theta: float = 10000.0,
                    max_position_embeddings: int = 1024, seed: int = 0,
                    overwrite: bool = False, tool_tokens: bool = False,
                    head_dim: int | None = None, rope_scaling: dict | None = None,
                    scaled_residual_init: bool = False,
                    model_vocab_size: int | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer.json (+ tokenizer_config.json).

    `vocab_size` is the tokenizer's (at most: the merges its small corpus allows stop at a few
    thousand); the model's embedding has the tokenizer's size, or `model_vocab_size` rows where
    that is larger, as released models pad theirs (Qwen2.5: 151,936 rows for 151,665 tokens):
    a benchmark at a real model's vocabulary asks for it there. Defaults tie the
    embeddings for Qwen2 and Qwen3 and untie them for Llama and Qwen3-MoE, as the public checkpoints
    do. `head_dim` (Llama, Qwen3) may differ from hidden_size / num_heads, as in Qwen3. The
    directory is written to a temp dir beside `out_dir` and renamed into place, so a crash never
    leaves a half-written model behind. `scaled_residual_init` draws the projections that write
    into the residual stream (attention's o_proj, the MLPs' down_proj) at std / sqrt(2 *
    layers), as Megatron initialises a model from scratch (`output_layer_init_method`).
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (pass overwrite=True to replace it)")
    if tie_word_embeddings is None:
        tie_word_embeddings = arch in ("qwen2", "qwen3")
    tok = build_tokenizer(vocab_size, seed)
    if tool_tokens:
        tok.add_special_tokens(TOOL_TOKENS)
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|pad|>")
    rows = max(tok.get_vocab_size(), model_vocab_size or 0)
    cfg = hf_config(arch, rows, hidden_size, num_layers, num_heads, num_kv_heads,
                    intermediate_size, tie_word_embeddings, rope_theta, max_position_embeddings,
                    eos, pad, head_dim, rope_scaling)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init at HF's default std (0.02) gives near-uniform logits; a larger scale gives the
    # tiny model a peaked distribution, which makes greedy and sampled tests less degenerate.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "a_layernorm.weight")):
                # away from HF's init (ones), so a dropped or misplaced q/k norm shows
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # a real correction bias changes which experts are chosen, not the weights
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed))
                        * 0.1)
        if scaled_residual_init:
            # The token's own embedding then stays a larger part of the last hidden state, so
            # (embeddings tied) the random model repeats its input token more often: 1.6% of
            # samples instead of 0.6% for the agent task's keys, which copying is learned from
            scale = (2 * num_layers) ** -0.5
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(scale)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
            bos_token=None, unk_token=None)
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote tiny %s model (%d params, vocab %d) to %s", arch,
                sum(p.numel() for p in model.parameters()), cfg.vocab_size, out)
    return out


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> None:
    """Command line of tools/make_tiny_model.py and `megarl make-tiny-model`."""
    import argparse

    p = argparse.ArgumentParser(prog="make-tiny-model",
                                description="Make a tiny HF-format model directory locally.")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--vocab", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=None,
                   help="per-head size (llama, qwen3); default hidden / heads")
    p.add_argument("--tie", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--scaled-residual-init", action="store_true",
                   help="o_proj and down_proj at std / sqrt(2 * layers), as Megatron inits")
    p.add_argument("--tool-tokens", action="store_true",
                   help="add Qwen's <tool_call>/<tool_response> markers as special tokens")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tie = None if a.tie == "auto" else a.tie == "yes"
    make_tiny_model(a.out_dir, a.arch, vocab_size=a.vocab, hidden_size=a.hidden,
                    num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                    intermediate_size=a.ffn, tie_word_embeddings=tie, rope_theta=a.rope_theta,
                    seed=a.seed, overwrite=a.overwrite, tool_tokens=a.tool_tokens,
                    scaled_residual_init=a.scaled_residual_init,
                    head_dim=a.head_dim)
