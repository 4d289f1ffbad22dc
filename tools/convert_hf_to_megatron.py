"""Convert an HF safetensors model to a Megatron dist-checkpoint at the given TP/PP.

    python tools/convert_hf_to_megatron.py --hf-dir outputs/tiny-qwen2 --out ckpt/mcore --tp 2
"""
from megarl.convert.cli import hf_to_megatron_main

if __name__ == "__main__":
    raise SystemExit(hf_to_megatron_main())
