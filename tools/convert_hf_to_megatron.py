"""Convert an HF safetensors model to a Megatron dist-checkpoint at the given TP/PP.

    python tools/convert_hf_to_megatron.py --hf-dir outputs/tiny-qwen2 --out ckpt/mcore --tp 2

Runs itself under torchrun with TP×PP ranks when that is more than one.
"""
import argparse
import logging


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megarl.utils.launch import ensure_world

    ensure_world(a.tp * a.pp)
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.convert.checkpoints import hf_to_mcore

    hf_to_mcore(a.hf_dir, a.out, a.tp, a.pp, a.params_dtype, a.make_vocab_size_divisible_by)
    destroy_distributed()


if __name__ == "__main__":
    main()
