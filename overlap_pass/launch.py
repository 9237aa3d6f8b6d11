"""Run a Python program with the overlap pass inside the default Inductor compile.

    torchrun --nproc-per-node 8 -m overlap_pass.launch torchtitan.train --module llama3 \\
        --config llama3_8b --compile.enable --parallelism.tensor_parallel_degree 8

    python3 -m overlap_pass.launch train.py --my-args ...

For programs whose compile call cannot say backend="overlap". torchtitan 0.3.0 is one: its
apply_compile refuses every backend but "inductor" and "aot_eager" for models with
FlexAttention, its Llama 3 configs among them. Here the program keeps backend="inductor" and
the pass runs in it, as with ``overlap_pass.config.enabled = True``, and Inductor's shape
padding is off (pipeline/passes.SAME_GRAPH_ON_EVERY_RANK); everything else is the program's own (it
runs as ``__main__``, with its own arguments).
"""

import runpy
import sys

import torch

from . import config
from .pipeline.passes import SAME_GRAPH_ON_EVERY_RANK

USAGE = "usage: python3 -m overlap_pass.launch (MODULE | SCRIPT.py) [ARGS ...]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return
    config.enabled = True
    for name, value in SAME_GRAPH_ON_EVERY_RANK.items():
        setattr(torch._inductor.config, name, value)
    target, sys.argv = argv[0], list(argv)
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
