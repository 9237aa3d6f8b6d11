"""The pairs themselves (docs/rewrites.md): find -> decide -> rewrite.

patterns.py: all-gather -> matmul and matmul -> reduce-scatter candidates in a post-grad graph,
and the graph vocabulary the other stages share.
decide.py: whether a match is worth and safe to rewrite, and which implementation it runs.
rewrite.py: the graph edits, one fused op per pair.
"""
