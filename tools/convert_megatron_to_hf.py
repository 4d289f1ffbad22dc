"""Convert a megarl Megatron dist-checkpoint (any TP/PP) to an HF safetensors model.

    python tools/convert_megatron_to_hf.py --ckpt ckpt/mcore --out outputs/exported [--tp 1]

The checkpoint is read at --tp/--pp (default 1/1, which reshards whatever it was saved with).
"""
import argparse
import logging


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megarl.utils.launch import ensure_world

    ensure_world(a.tp * a.pp)
    from megarl.backends.megatron.parallel import destroy_distributed
    from megarl.convert.checkpoints import mcore_to_hf

    mcore_to_hf(a.ckpt, a.out, a.tp, a.pp, a.dtype)
    destroy_distributed()


if __name__ == "__main__":
    main()
