"""overlap's ops: their schemas, fake kernels and reference decompositions, by op family
(matmul_ops.py, scaled_ops.py, all_reduce_op.py; schedule.py: the chunk order they share), and
their registration with torch (registry.py, which ``import overlap_pass`` imports).

The families do not import the registry, so the CUDA lowering can import them below it."""
