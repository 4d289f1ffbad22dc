"""Make a tiny HF model directory (random weights, locally trained tokenizer).

    python tools/make_tiny_model.py outputs/tiny-qwen2 --arch qwen2 --layers 2 --hidden 64
"""
from megarl.utils.tiny_model import main

if __name__ == "__main__":
    main()
