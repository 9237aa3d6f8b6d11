"""The pairs themselves (docs/rewrites.md): find -> decide -> rewrite.

find_all_gathers.py, find_reduce_scatters.py: all-gather -> matmul and matmul -> reduce-scatter
candidates in a post-grad graph; matches.py: what they return (a match, or why there is none);
matmul_checks.py, layouts.py: what both accept of a matmul, and of a collective along a later dim.
decide.py: whether a match is worth and safe to rewrite, and which implementation it runs.
rewrite.py: the graph edits, one fused op per pair.
The graph vocabulary every stage shares is overlap_pass/graph/'s.
"""
