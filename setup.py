"""megarl: asynchronous RL post-training of LLMs on Megatron-core + SGLang + Ray."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Asynchronous RL post-training (GRPO/PPO) on Megatron-core, SGLang and Ray",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    # verl's key table, read by megarl.config.verl_keys when the loader is imported
    package_data={"megarl.config": ["verl_keys.tsv"]},
    install_requires=[
        # CPU setups (tools/setup_env.sh) install the local CPU wheel torch==2.13.0 first, which
        # this admits, so pip keeps it. The bound admits 2.14.1, the torch the `gpu` extra pins,
        # and stops there so pip never drifts to a newer (CUDA) build on its own.
        "torch>=2.6,<2.15",
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
        "pillow>=10",  # the run's timeline picture (timeline.png, TensorBoard)
    ],
    extras_require={
        # One consistent GPU set (docs/install_gpu.md; tests/contract checks the pins):
        "gpu": [
            # The stock release megarl's wire contract is checked against
            # (megarl.backends.sglang.SGLANG_VERSION, tests/contract): bump the two together.
            "sglang==0.5.23",
            # sglang 0.5.23 itself requires torch==2.14.1 (a CUDA 13 build on PyPI); pinned
            # here so the whole set names one torch.
            "torch==2.14.1",
            # megatron-core 0.16.1 is tested with transformer-engine>=2.9.0a0,<2.12.0 (its own
            # `dev` extra); TE's torch part asks only torch>=2.1 and is built against the
            # installed torch, so it does not contradict the pin above.
            "transformer-engine[pytorch]>=2.9,<2.12",
        ],
        # msgspec: loads stock SGLang's generated API types in tests/contract.
        # pytest 9.2 keeps node ids where pytest-xdist 3.8's loadgroup can no longer tag them, so
        # `--dist loadgroup` silently stops grouping (pytest-xdist #1386); tests/conftest.py
        # refuses to run split groups
        # and the two trackers below, the same lines (tests/contract reads this dict as a literal)
        "test": ["pytest>=8,<9.2", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "msgspec>=0.18",
                 "wandb>=0.19,<1", "mlflow-skinny>=3.0,<4", "sqlalchemy>=2.0", "alembic>=1.13",
                 "math-verify[antlr4_13_2]>=0.9,<1"],
        # trainer.logger's trackers (docs/observability.md)
        "wandb": ["wandb>=0.19,<1"],
        # the opt-in Math-Verify reward (megarl.reward.mathverify), as verl's math_verify
        "math": ["math-verify[antlr4_13_2]>=0.9,<1"],
        # MLflow's client alone (no server, UI or ML flavours) and what its SQLite store needs:
        # the default store (a run's mlflow.db), as MLflow 3 refuses file stores
        "mlflow": ["mlflow-skinny>=3.0,<4", "sqlalchemy>=2.0", "alembic>=1.13"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
