"""The FX graph vocabulary every stage shares; normalize/, regions/ and fusion/ build on it, and
nothing here imports from them.

nodes.py: the op targets (collectives, views, matmuls, casts) and what a node's neighbours
and metadata say about it.
sizes.py: sizes that may be symbolic, compared without guards and spelled as graph arguments.
edits.py: adding nodes with their fake values, reshaping, erasing what nothing reads; a
graph copied and restored where a stage's edits fail.
records.py: the decision record of each candidate the pass considers.
"""
