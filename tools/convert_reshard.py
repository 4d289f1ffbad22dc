"""Rewrite a megarl Megatron dist-checkpoint for another TP/PP layout (optimizer state dropped).

    python tools/convert_reshard.py --ckpt ckpt/mcore-tp2 --out ckpt/mcore-pp2 --tp 1 --pp 2
"""
from megarl.convert.cli import reshard_main

if __name__ == "__main__":
    raise SystemExit(reshard_main())
