"""Shard regions: work moved onto a rank's 1/W of the rows (docs/plain_tp.md, docs/float8.md).

rows.py: which ops can run row-wise, on a rank's share of the tokens.
split_*.py, the all-reduce split: an all-reduce becomes a reduce-scatter and an all-gather
around the row-wise ops after it (plain tensor parallelism), and a quantize moves before its
gather. split_regions.py: what a region is; split_walk.py: finding and deciding the regions;
split_cost.py: whether one pays; split_records.py: their decisions.json records; split_apply.py:
the rewrite onto the shard.
passengers.py: plain all-gathers of the same rows ride along in a fused all-gather op.
tail_matmuls.py: a reduce-scatter op's weight gradients run inside it, while its last partials
travel.
early_all_reduces.py: small all-reduces computed from the graph's inputs alone run as one.
small_all_reduces.py: every small all-reduce runs as overlap::all_reduce.
regather.py: in the joint graph, gathered activations marked to be gathered again in the
backward.
"""
