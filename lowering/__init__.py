"""CUDA implementations of the overlap ops: symmetric-memory workspace (symm.py), the variants
of each op (all_gather_matmul.py), the per-shape choice among them (choose.py) and the kernels
that ops/registry.py registers for CUDA tensors (dispatch.py). Imported on first use, not by
``import overlap_pass``."""
