"""Shard regions: work moved onto a rank's 1/W of the rows (docs/plain_tp.md, docs/float8.md).

rows.py: which ops can run row-wise, on a rank's share of the tokens.
all_reduce_split.py: an all-reduce becomes a reduce-scatter and an all-gather around the
row-wise ops after it (plain tensor parallelism), and a quantize moves before its gather.
passengers.py: plain all-gathers of the same rows ride along in a fused all-gather op.
"""
