"""CUDA implementations of the overlap ops (symmetric-memory workspace, chunk copies, launch).

Empty until the GPU kernels land; the ops run their reference decomposition meanwhile.
"""
