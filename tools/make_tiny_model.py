"""Make a tiny HF-format model directory (random weights, locally trained tokenizer).

    python tools/make_tiny_model.py outputs/tiny-qwen2 --arch qwen2 --layers 2 --hidden 64
"""
import argparse
import logging

from megarl.utils.tiny_model import ARCHS, make_tiny_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--vocab", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--tie", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tie = None if a.tie == "auto" else a.tie == "yes"
    make_tiny_model(a.out_dir, a.arch, vocab_size=a.vocab, hidden_size=a.hidden,
                    num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                    intermediate_size=a.ffn, tie_word_embeddings=tie, rope_theta=a.rope_theta,
                    seed=a.seed, overwrite=a.overwrite)


if __name__ == "__main__":
    main()
