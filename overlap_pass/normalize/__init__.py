"""Before matching: one form for what models write several ways (docs/rewrites.md, docs/float8.md).

waits.py: a collective waited on more than once is read through one wait_tensor.
permutes.py: a permute that moves a gathered tensor's rank dim moves in front of its all-gather.
casts.py: a cast that narrows a gathered tensor moves in front of its all-gather.
float8.py: torchao's rowwise float8 matmul is written as one _scaled_mm again.
"""
