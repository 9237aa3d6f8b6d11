"""Triton kernels and device helpers (wait, signal) for the overlap ops.

Empty until the GPU kernels land.
"""
