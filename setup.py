from setuptools import setup

setup(
    name="overlap",
    version="0.1.0",
    description="torch.compile backend and Inductor pass that overlaps tensor-parallel "
    "collectives with their matmuls",
    python_requires=">=3.10",
    # One import namespace: lowering/ and templates/ install as overlap_pass.lowering and
    # overlap_pass.templates; nothing generic lands at the top of site-packages.
    packages=[
        "overlap_pass",
        "overlap_pass.ops",
        "overlap_pass.graph",
        "overlap_pass.normalize",
        "overlap_pass.regions",
        "overlap_pass.fusion",
        "overlap_pass.shapes",
        "overlap_pass.pipeline",
        "overlap_pass.lowering",
        "overlap_pass.templates",
    ],
    package_dir={
        "overlap_pass": "overlap_pass",
        "overlap_pass.lowering": "lowering",
        "overlap_pass.templates": "templates",
    },
    # torch is not listed: pip would fetch a CUDA build onto CPU machines. tools/install.sh
    # installs the right build first.
    install_requires=["sympy"],
    # numpy < 2.3: triton 3.6's interpreter (the CPU kernel tests) breaks with numpy 2.4.
    # torchtitan: the trainer whose Llama 3 the tests and benchmarks/bench_torchtitan run (Python
    # 3.11+; it keeps an installed torch 2.11 or later).
    extras_require={
        "test": ["pytest", "expecttest", "numpy<2.3"],
        "torchtitan": ["torchtitan==0.3.0"],
        # Hugging Face transformers' Llama with its own tp_plan (plain TP); accelerate: its
        # from_pretrained with a DistributedConfig needs it
        "hf": ["transformers==5.23.0", "accelerate==1.15.0"],
        # torchao's Float8 training linears (torchtitan's Float8LinearConverter), whose graphs the
        # float8 tests compile
        "float8": ["torchao==0.18.0"],
    },
    entry_points={
        "torch_dynamo_backends": ["overlap = overlap_pass.backend:overlap_backend"],
    },
)
