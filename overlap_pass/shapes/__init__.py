"""Shapes that change between calls (backend="overlap", graphs on symbolic token counts): the
ranges of token counts a graph is compiled for where a plain-TP split pays only from some count
on (size_ranges.py), and a new count's first calls on plain Inductor's graph (new_counts.py)."""
