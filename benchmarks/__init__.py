"""The benchmark harness: the tools that time overlap against plain Inductor, PyTorch's async
TP and NCCL + cuBLAS, the models they run, and (beside them, as shell scripts) one script per
table of docs/benchmarks.md. Run from the repository root: ``python3 -m benchmarks.bench_model``."""
