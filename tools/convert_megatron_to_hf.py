"""Convert a megarl Megatron dist-checkpoint (any TP/PP) to an HF safetensors model.

    python tools/convert_megatron_to_hf.py --ckpt ckpt/mcore --out outputs/exported [--tp 1]
"""
from megarl.convert.cli import megatron_to_hf_main

if __name__ == "__main__":
    raise SystemExit(megatron_to_hf_main())
