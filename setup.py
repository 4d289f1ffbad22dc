"""megarl: asynchronous RL post-training of LLMs on Megatron-core + SGLang + Ray."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Asynchronous RL post-training (GRPO/PPO) on Megatron-core, SGLang and Ray",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        # 2.13.0 is the local CPU wheel; an upper bound keeps pip from pulling a CUDA build.
        "torch>=2.6,<2.14",
        "megatron-core>=0.16.1,<0.17",
        "ray[default]>=2.40",
        "omegaconf>=2.3",
        "tensorboard>=2.15",
        "numpy>=1.26",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "pyarrow>=15",
        "psutil>=5.9",  # megatron.core.dist_checkpointing needs it
        "einops>=0.7",
        "pyyaml>=6",
        "aiohttp>=3.9",  # rollout HTTP server and SGLang client
    ],
    extras_require={
        "gpu": ["sglang>=0.5", "transformer-engine[pytorch]>=2.0"],
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
