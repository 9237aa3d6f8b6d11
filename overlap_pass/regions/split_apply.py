"""apply(graph, plan): the accepted regions of the all-reduce split rewritten onto the
shard: the all-reduces become reduce-scatters, each region op runs on the rank's rows, and
what is read outside the region is all-gathered (split_regions.py says how).
"""

import math
import operator

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from ..graph.edits import call, erase_dead, reshape
from ..graph.nodes import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, meta_val
from ..graph.sizes import arith, divisible, is_static, same, same_shape, size_arg
from . import rows
from .split_regions import FLAT, ROWS_OPERAND, Region, padded_producer, padded_readers, random
from .split_walk import Plan

aten = torch.ops.aten


class _Sharder:
    """Builds one region's ops on the shard, each placed before the op it replaces."""

    def __init__(self, graph: Graph, region: Region) -> None:
        self.graph, self.region = graph, region
        world = region.world_size
        # a token count W does not divide (for every value of its symbols): every shard holds
        # ceil(T / W) rows, the last ones zero rows past the real tokens
        self.padded = not divisible(region.tokens, world)
        self.rows = (region.tokens + world - 1) // world if self.padded else region.tokens // world
        self.start = region.rank * self.rows
        self.dead: list[Node] = []  # matmuls made again on padded rows, and their views
        self._padding_args: dict | None = None
        # tensors that stay, whose dims hold the region's symbolic sizes (beside the graph's
        # SymInt inputs): the all-reduced and the gathered tensors' inputs
        self.sources = [ar.args[0] for ars in region.entries.values() for ar in ars]
        self.sources += [g.args[0] for g in region.gathers.values()]
        self.shard: dict[Node, Node] = {}
        self.cut: dict[Node, Node] = {}  # replicated operand -> this rank's rows of it
        self.made: dict[str, Node] = {}
        self.structures: dict[Node, str] = {}

    def entry(self, node: Node) -> Node:
        if node in self.region.gathers:  # the gathered tensor's shard is the collective's input
            shard = self.region.gathers[node].args[0]
            return reshape(self.graph, shard, [self.rows, rows.tensor_shape(shard)[-1]])
        if self.padded:
            terms = [self._padded_term(ar.args[0]) for ar in self.region.entries[node]]
        else:
            terms = [reshape(self.graph, ar.args[0], self._rows_shape(ar)) for ar in self.region.entries[node]]
        summed = terms[0]
        for term in terms[1:]:
            summed = call(self.graph, aten.add.Tensor, (summed, term))
        scattered = call(
            self.graph, REDUCE_SCATTER, (summed, "sum", self.region.world_size, self.region.group_name)
        )
        return call(self.graph, WAIT, (scattered,))

    def _padding(self) -> dict:
        """The padded layout's sizes as graph arguments (ints where static; nodes made once, at
        the first entry, before every use): tokens, rows a shard, this rank's start and end,
        the zero rows added."""
        if self._padding_args is None:
            graph, world, rank = self.graph, self.region.world_size, self.region.rank
            tokens = size_arg(graph, self.region.tokens, self.sources)
            shard_rows = arith(graph, operator.floordiv, arith(graph, operator.add, tokens, world - 1), world)
            self._padding_args = {
                "tokens": tokens,
                "rows": shard_rows,
                "start": arith(graph, operator.mul, shard_rows, rank),
                "end": arith(graph, operator.mul, shard_rows, rank + 1),
                "pad": arith(graph, operator.sub, arith(graph, operator.mul, shard_rows, world), tokens),
            }
        return self._padding_args

    def _pad_rows(self, node: Node) -> Node:
        """A [T, n] tensor with zero rows added to W * ceil(T / W)."""
        return call(self.graph, aten.constant_pad_nd.default, (node, [0, 0, 0, self._padding()["pad"]], 0.0))

    def _padded_term(self, reduced: Node) -> Node:
        """An all-reduced tensor on the padded rows. A matmul's result is made again from its
        rows padded with zeros, so that the reduce-scatter still fuses with a matmul (Inductor
        fuses the padding into the kernel that writes those rows); anything else is padded."""
        found = padded_producer(reduced, self.region.tokens)
        if found is None:
            return self._pad_rows(reshape(self.graph, reduced, [self.region.tokens, rows.tensor_shape(reduced)[-1]]))
        views, producer = found
        args, position = list(producer.args), ROWS_OPERAND[producer.target]
        args[position] = self._pad_rows(args[position])
        self.dead += [*views, producer]
        return call(self.graph, producer.target, tuple(args), dict(producer.kwargs))

    def _real_rows(self, shard: Node, reduce_op: str) -> Node:
        """``shard`` with its padding rows set to ``reduce_op``'s identity, so that a reduction
        over the tokens reads the real rows alone (padding rows may hold a bias added, say)."""
        padding, val = self._padding(), meta_val(shard)
        index = call(
            self.graph, torch.ops.prims.iota.default, (padding["rows"],),
            {"start": padding["start"], "step": 1, "dtype": torch.int64, "device": val.device, "requires_grad": False},
        )  # fmt: skip
        real = call(self.graph, aten.lt.Scalar, (index, padding["tokens"]))
        real = call(self.graph, aten.reshape.default, (real, [-1] + [1] * (val.dim() - 1)))
        identity = {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduce_op]
        return call(self.graph, aten.where.ScalarOther, (real, shard, identity))

    def _rows_shape(self, node: Node) -> list[int]:
        shape = rows.tensor_shape(node)
        return [self.region.tokens, shape[-1]]

    def _operand(self, node, out_shape: tuple):
        """An argument of a row-wise op whose output has ``out_shape``, on the shard."""
        if not isinstance(node, Node):
            return node
        if node in self.shard:
            return self.shard[node]
        shape = rows.tensor_shape(node)
        if shape is None:
            return node
        if rows.row_free(shape):
            return reshape(self.graph, node, shape[-1:]) if len(shape) > 1 else node
        if node not in self.cut:
            full = node
            rows_shape = [*out_shape[:-1], shape[-1]]
            if not same_shape(shape, rows_shape):  # broadcast along some rows: make every row explicit
                full = call(self.graph, aten.expand.default, (node, self._sizes(rows_shape)))
            flat = reshape(self.graph, full, [self.region.tokens, shape[-1]])
            if self.padded:  # (Inductor reads the slice of the padding in place)
                flat = self._pad_rows(flat)
                bounds = [self._padding()["start"], self._padding()["end"]]
            else:
                bounds = self._sizes([self.start, self.start + self.rows])
            self.cut[node] = call(self.graph, aten.slice.Tensor, (flat, 0, *bounds))
        return self.cut[node]

    def _sizes(self, sizes) -> list:
        """Sizes as graph arguments: symbolic ones as nodes (sizes.size_arg; a padded shard's
        rows as the node computing them)."""
        return [
            self._padding()["rows"] if self.padded and not is_static(s) and same(s, self.rows)
            else size_arg(self.graph, s, self.sources)
            for s in sizes
        ]  # fmt: skip

    def _call(self, target, args: tuple, kwargs: dict | None = None) -> Node:
        """One node per distinct op on the shard: torchao quantizes a gathered tensor twice
        along the same ops (its forward and its saved copy, each with its own copy of the
        scale's ops), which then share one gather."""
        if random(target):  # two draws are two values
            return call(self.graph, target, args, kwargs)
        key = repr((target, map_arg((args, kwargs or {}), self._structure)))
        if key not in self.made:
            self.made[key] = call(self.graph, target, args, kwargs)
        return self.made[key]

    def _structure(self, node: Node) -> str:
        """A key that elementwise ops outside the region share when they compute the same
        values from the same nodes."""
        if node not in self.structures:
            if node.op == "call_function" and rows.is_pointwise(node) and not random(node.target):
                self.structures[node] = repr((node.target, map_arg((node.args, node.kwargs), self._structure)))
            else:
                self.structures[node] = node.name
        return self.structures[node]

    def op(self, node: Node, rule: str) -> Node:
        source = next(a for a in node.all_input_nodes if a in self.shard)
        if rule == rows.SAME:
            return self.shard[source]
        if rule == rows.GETITEM:
            return self._call(operator.getitem, (self.shard[source], node.args[1]))
        if rule == rows.EXPAND:
            return self._call(aten.expand.default, (self.shard[source], self._sizes([self.rows, node.args[1][-1]])))
        if rule == rows.REDUCE_LAST:
            args = (self.shard[source], [-1], *node.args[2:])
            return self._call(node.target, args, dict(node.kwargs))
        out_shape = rows.tensor_shape(node)
        args, kwargs = map_arg((node.args, dict(node.kwargs)), lambda a: self._operand(a, out_shape))
        return self._call(node.target, args, kwargs)

    def across_tokens(self, node: Node) -> Node:
        """A sum, max or min over every token = the shard's, all-reduced with the same op."""
        shard = self.shard[node.args[0]]
        if self.padded:
            shard = self._real_rows(shard, rows.TOKEN_REDUCE_OPS[node.target])
        if len(node.args) == 1:  # over every dim: max.default and the like
            local = self._call(node.target, (shard,), dict(node.kwargs))
        else:  # over the leading dims (the shard's dim 0), or every dim
            every_dim = len(node.args[1]) == len(rows.tensor_shape(node.args[0]))
            dims = [0, 1] if every_dim else [0]
            kwargs = {k: v for k, v in node.kwargs.items() if k != "keepdim"}
            local = self._call(node.target, (shard, dims), kwargs)
        reduced = self._call(ALL_REDUCE, (local, rows.TOKEN_REDUCE_OPS[node.target], self.region.group_name))
        return reshape(self.graph, self._call(WAIT, (reduced,)), meta_val(node).shape)

    def gather_exits(self, order: dict[Node, int]) -> None:
        """All-gathers each region tensor that is read outside, once per shard, right after the
        shard exists; its wait sits before the first reader."""
        outside = self.region.exits
        by_root: dict[Node, list[Node]] = {}
        for node in outside:
            by_root.setdefault(self.shard[node], []).append(node)
        for shard, nodes in by_root.items():
            readers = sorted({u for n in nodes for u in outside[n]}, key=order.__getitem__)
            with self.graph.inserting_after(shard):
                gather = self._all_gather(shard)
            with self.graph.inserting_before(readers[0]):
                gathered = self._gathered(gather, meta_val(shard).dtype)
                real = gathered
                if self.padded:  # the padding rows off
                    real = call(self.graph, aten.slice.Tensor, (gathered, 0, 0, self._padding()["tokens"]))
                for node in nodes:
                    full = reshape(self.graph, real, meta_val(node).shape)
                    # in graph order: the order ``full`` gains its users is the order later
                    # matches list them in, and every rank must build the same collectives
                    # (a set's order differs between processes)
                    for user in sorted(set(outside[node]), key=order.__getitem__):
                        if not (self.padded and self._on_padded_rows(user, node, gathered)):
                            user.replace_input_with(node, full)

    def _on_padded_rows(self, user: Node, node: Node, gathered: Node) -> bool:
        """Where ``user`` reads ``node`` as padded_readers says: each matmul made again on the
        padded gathered rows and its result sliced to the real ones (a view), so that the
        all-gather fuses with it. Whether it was."""
        found = padded_readers(user, node, self.region.tokens)
        if found is None:
            return False
        source, matmuls = found
        for matmul in matmuls:
            args = list(matmul.args)
            args[ROWS_OPERAND[matmul.target]] = gathered
            with self.graph.inserting_before(matmul):
                remade = call(self.graph, matmul.target, tuple(args), dict(matmul.kwargs))
                real = call(self.graph, aten.slice.Tensor, (remade, 0, 0, self._padding()["tokens"]))
            matmul.replace_all_uses_with(real)
            self.dead.append(matmul)
        if source is user:
            self.dead.append(user)
        return True

    def _all_gather(self, shard: Node) -> Node:
        """The all-gather of a [rows, n] shard in the region's layout; float8 moves as bytes
        (gloo has no float8)."""
        layout, world_size = self.region.layout, self.region.world_size
        if layout != FLAT:  # the shard in the gathered tensor's dims, for DTensor's split/cat
            shape = list(layout.shape[:-1]) + [rows.tensor_shape(shard)[-1]]
            shape[layout.dim] //= world_size
            shard = reshape(self.graph, shard, shape)
        if meta_val(shard).dtype.itemsize == 1 and meta_val(shard).dtype != torch.uint8:
            shard = call(self.graph, aten.view.dtype, (shard, torch.uint8))
        return call(self.graph, ALL_GATHER, (shard, world_size, self.region.group_name))

    def _gathered(self, gather: Node, dtype: torch.dtype) -> Node:
        gathered = call(self.graph, WAIT, (gather,))
        layout, world_size = self.region.layout, self.region.world_size
        if layout != FLAT:
            (size,) = self._sizes([rows.tensor_shape(gathered)[0] // world_size])
            pieces = call(self.graph, aten.split.Tensor, (gathered, size))
            chunks = [call(self.graph, operator.getitem, (pieces, i)) for i in range(world_size)]
            gathered = call(self.graph, aten.cat.default, (chunks, layout.dim))
        if meta_val(gathered).dtype != dtype:
            gathered = call(self.graph, aten.view.dtype, (gathered, dtype))
        return gathered


def apply(graph: Graph, split_plan: Plan) -> None:
    """Rewrites every accepted region onto the shard; the all-reduces and the full-size ops
    they fed go."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    dead = []
    for region in split_plan.accepted():
        sharder = _Sharder(graph, region)
        for node in sorted([*region.nodes, *region.token_reductions], key=order.__getitem__):
            with graph.inserting_before(node):
                if node in region.entries or node in region.gathers:
                    sharder.shard[node] = sharder.entry(node)
                elif node in region.nodes:
                    sharder.shard[node] = sharder.op(node, region.nodes[node])
                else:
                    node.replace_all_uses_with(sharder.across_tokens(node))
        sharder.gather_exits(order)
        dead += [*region.nodes, *region.token_reductions, *region.absorbed, *sharder.dead]
    erase_dead(graph, dead)
