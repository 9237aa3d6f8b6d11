"""rewrite_*: each matched pair becomes its fused op (rewrite_accepted: every accepted one, in
order); attach_passenger seats a plain all-gather in one. The edits every stage makes (call, reshape, erase_dead) are graph/edits.py's.

Operands are read from the live graph (the collective and matmul nodes), not from the frozen
match, so that rewriting one end of a back-to-back chain never leaves the other end's match
pointing at an erased node.
"""

import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from ..graph.edits import call, erase_dead, reshape
from ..graph.nodes import BMM, SCALED_MM, depends_on, graph_order, is_transpose, scaled_mm_args
from ..graph.records import Decision
from ..ops import registry  # noqa: F401  (registers torch.ops.overlap)
from .matches import ALL_GATHER_MATMUL, AllGatherMatmulMatch, Candidate, ContractionUse, Match, MatmulReduceScatterMatch

aten = torch.ops.aten


def _mm_operands(mm: Node) -> tuple[Node, Node, Node | None]:
    """(rows, mat2, bias) of an aten.mm, aten.addmm or aten._scaled_mm node."""
    if mm.target is aten.addmm.default:
        return mm.args[1], mm.args[2], mm.args[0]
    if mm.target is SCALED_MM:
        named = scaled_mm_args(mm)
        return named["self"], named["mat2"], named["bias"]
    return mm.args[0], mm.args[1], None


def _shared_matrix(graph: Graph, mat2: Node) -> tuple[Node, list[Node]]:
    """The [K, N] matrix a bmm's mat2 [B, K, N] repeats over its batch
    (matmul_checks.shared_matrix), and the nodes that made the batch of it: the 2-D tensor it
    was unsqueezed and expanded from where the graph holds it (NeMo Automodel's
    expand(unsqueeze(w.t(), 0)), or that transposed per batch element), else its first batch
    element."""
    node, transposed, chain = mat2, False, [mat2]
    if node.target is aten.permute.default and [d % 3 for d in node.args[1]] == [0, 2, 1]:
        node, transposed = node.args[0], True
        chain.append(node)
    if node.target is aten.expand.default:
        node = node.args[0]
        chain.append(node)
    want = list(mat2.meta["val"].shape[1:])
    if node.target is aten.unsqueeze.default and node.args[1] == 0:
        base = node.args[0]
        if transposed and is_transpose(base) and list(base.args[0].meta["val"].shape) == want:
            return base.args[0], chain + [base]
        if list(base.meta["val"].shape) == (want[::-1] if transposed else want):
            return (call(graph, aten.permute.default, (base, [1, 0])) if transposed else base), chain
    return call(graph, aten.select.int, (mat2, 0, 0)), []


def _matrix_operands(graph: Graph, mm: Node) -> tuple[tuple[Node, Node, Node | None], list[Node]]:
    """_mm_operands with a bmm's shared mat2 as its [K, N] matrix, and the nodes that the bmm
    alone read on the way to it."""
    rows, mat2, bias = _mm_operands(mm)
    if mm.target is not BMM:
        return (rows, mat2, bias), []
    matrix, chain = _shared_matrix(graph, mat2)
    return (rows, matrix, bias), chain


def _scales(mm: Node) -> tuple[Node, Node]:
    named = scaled_mm_args(mm)
    return named["scale_a"], named["scale_b"]


def _chain(start: Node, stop: Node) -> list[Node]:
    """Nodes from ``start`` back to ``stop`` along first arguments, plus split outputs."""
    nodes, node = [], start
    while node is not stop and isinstance(node, Node) and node.args:
        nodes.append(node)
        if node.target is aten.cat.default:
            nodes += list(node.args[0])
            node = node.args[0][0].args[0]  # getitem -> split
            continue
        node = node.args[0]
    return nodes + [stop]


def _contracted_operand(use: ContractionUse) -> Node:
    """The live operand that a contraction multiplies the gathered rows with, as it appears in
    the graph: [M, K] for g^T @ other, [K, M] for other @ g."""
    return use.mm.args[1] if use.gathered_left else use.mm.args[0]


def would_create_cycle(match: Match) -> bool:
    """Whether the op would read a value computed from its own result, on the graph as it is
    now (after the rewrites before it, sorted): the inputs of an all-gather op must not depend
    on the all-gather. A reduce-scatter's nodes form a single-user tree, which cannot close a
    loop."""
    if not isinstance(match, AllGatherMatmulMatch):
        return False
    inputs = [match.gather.args[0]] + [_contracted_operand(use) for use in match.contractions]
    for use in match.matmuls:
        _, mat2, bias = _mm_operands(use.mm)
        inputs += [mat2] + ([bias] if bias is not None else [])
        if use.mm.target is SCALED_MM:
            inputs += list(_scales(use.mm))
    order = graph_order(match.gather.graph)
    return any(depends_on(node, match.gather, order) for node in inputs)


def _rows_operand(graph: Graph, use: ContractionUse) -> Node:
    """[M, K] rows for the op's contract_with: other @ g reads other^T, taken from under its
    transpose where the graph has one. A bmm's other ([B, M / B, K], or [B, K, M / B]
    transposed the same way) gives its blocks' rows, flattened."""
    operand = _contracted_operand(use)
    if use.mm.target is BMM:
        width = operand.meta["val"].shape[-1 if use.gathered_left else 1]
        if not use.gathered_left:
            under = operand.args[0] if operand.target is aten.permute.default else None
            if under is not None and [d % 3 for d in operand.args[1]] == [0, 2, 1]:
                operand = under
            else:
                operand = call(graph, aten.permute.default, (operand, [0, 2, 1]))
        return call(graph, aten.reshape.default, (operand, [-1, width]))
    if use.gathered_left:
        return operand
    if is_transpose(operand) and operand.args[0].meta["val"].dim() == 2:
        return operand.args[0]
    return call(graph, aten.permute.default, (operand, [1, 0]))


def rewrite_all_gather_matmul(graph: Graph, match: AllGatherMatmulMatch) -> Node:
    """
        g = wait(all_gather(shard)) [-> split -> cat(gather_dim)]
        y_i = mm(reshape(g), w_i) (+ b_i)
        dw_j = mm(permute(reshape(g)), o_j)   or   mm(x_j, reshape(g))
    becomes
        g, ys = overlap.all_gather_matmul(shard, [w_i], [b_i], gather_dim, ...,
                                          contract_with=[o_j or x_j^T], gathered_left=[...])
        y_i = reshape(ys[i]);  dw_j = ys[len(w) + j]
    and the same for bmms over [B, M / B, K] blocks of g's rows: y_i = bmm(g, expand(w_i)) as
    the matmul of the flattened rows with w_i, dw_j = sum_0(bmm(x_j, g)) as x_j's flattened
    rows contracted with g's.
    """
    mms = [use.mm for use in match.matmuls + match.contractions]
    values = [use.mm for use in match.matmuls] + [use.summed or use.mm for use in match.contractions]
    first_mm = min(mms, key=graph_order(graph).__getitem__)
    return_gathered = bool(match.other_users)
    dead = mms + values + _chain(match.gathered, match.gather)
    for use in match.matmuls:
        dead += _chain(_mm_operands(use.mm)[0], match.gathered)
    for use in match.contractions:
        gathered_side = use.mm.args[0] if use.gathered_left else use.mm.args[1]
        dead += _chain(gathered_side, match.gathered) + [_contracted_operand(use)]
    with graph.inserting_before(first_mm):
        operands = []
        for use in match.matmuls:
            matrix_operands, batched = _matrix_operands(graph, use.mm)
            operands.append(matrix_operands)
            dead += batched
        make = _all_gather_matmul if match.scaled is None else _all_gather_scaled_matmul
        op = make(graph, match, operands, return_gathered)
        if match.scaled is not None:
            dead += list(match.scaled.scale_gather)
        outputs = call(graph, operator.getitem, (op, 1))
        for index, value in enumerate(values):
            out = call(graph, operator.getitem, (outputs, index))
            value.replace_all_uses_with(reshape(graph, out, value.meta["val"].shape, [match.gather.args[0]]))
        if return_gathered:
            match.gathered.replace_all_uses_with(call(graph, operator.getitem, (op, 0)))

    erase_dead(graph, dead)
    return op


def _all_gather_matmul(graph: Graph, match: AllGatherMatmulMatch, operands, return_gathered: bool) -> Node:
    return call(
        graph,
        torch.ops.overlap.all_gather_matmul.default,
        (
            match.gather.args[0],
            [mat2 for _, mat2, _ in operands],
            [bias for _, _, bias in operands],
            match.gather_dim,
            match.world_size,
            match.group_name,
            return_gathered,
            [_rows_operand(graph, use) for use in match.contractions],
            [use.gathered_left for use in match.contractions],
        ),
    )


def _all_gather_scaled_matmul(graph: Graph, match: AllGatherMatmulMatch, operands, return_gathered: bool) -> Node:
    """The overlap.all_gather_scaled_matmul call of a float8 match: the shard as float8 (a view
    of the bytes where they were gathered as uint8), its rowwise scale in its shape."""
    shard, scaled = match.gather.args[0], match.scaled
    if match.byte_view is not None:
        shard = call(graph, aten.view.dtype, (shard, match.byte_view))
    rows_scale = scaled.rows_scale
    if scaled.rowwise:
        rows_scale = reshape(graph, rows_scale, [*shard.meta["val"].shape[:-1], 1], [shard])
    return call(
        graph,
        torch.ops.overlap.all_gather_scaled_matmul.default,
        (
            shard,
            rows_scale,
            [mat2 for _, mat2, _ in operands],
            [use.mat2_scale for use in match.matmuls],
            [bias for _, _, bias in operands],
            match.gather_dim,
            match.world_size,
            match.group_name,
            scaled.out_dtype,
            scaled.use_fast_accum,
            return_gathered,
        ),
    )


def _computed_after(node: Node, host: Node, order: dict[Node, int]) -> set[Node]:
    """``node`` and the nodes it is computed from that sit after ``host``."""
    stack, found = [node], set()
    while stack:
        current = stack.pop()
        if current in found or order[current] < order[host]:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes)
    return found


def attach_passenger(graph: Graph, host: Node, rider, at) -> Node:
    """
        _, ys, ps = overlap.all_gather_scaled_matmul(shard, ..., passengers=[p, ...])
        g = wait(all_gather(s)) [-> split -> cat(gather_dim)]    (s computed after the op)
    becomes
        s computed before the op: the nodes it needs that sat after it, moved up in their order
        _, ys, ps = overlap.all_gather_scaled_matmul(shard, ..., passengers=[p, ..., s])
        g = ps[-1]
    and the same for an overlap.all_gather_matmul, whose gathered passengers are the last of
    its outputs (after the matmuls' and the contractions'). ``rider``: a passengers.Rider whose
    shard does not depend on ``host``; ``at``: the host's passengers.HostArgs. Returns the new
    op; the graph may need sorting after (users of g that sat before the op)."""
    order = graph_order(graph)
    for node in sorted(_computed_after(rider.shard, host, order), key=order.__getitem__):
        host.prepend(node)
    args = list(host.args)
    if len(args) < at.passengers:  # the optional arguments before the passengers spelled out
        args += at.defaults[len(args) - at.passengers :]
    riders = list(args[at.passengers] or []) if len(args) > at.passengers else []
    with graph.inserting_before(host):
        op = call(graph, host.target, (*args[: at.passengers], riders + [rider.shard]), dict(host.kwargs))
        host.replace_all_uses_with(op)
        if host.target is torch.ops.overlap.all_gather_scaled_matmul.default:
            outputs, index = call(graph, operator.getitem, (op, 2)), len(riders)
        else:  # after one output per mat2 and per contraction
            contract_with = args[at.gather_dim + 4] or []
            outputs, index = call(graph, operator.getitem, (op, 1)), len(args[1]) + len(contract_with) + len(riders)
        gathered = call(graph, operator.getitem, (outputs, index))
    dead = _chain(rider.gathered, rider.gather)
    rider.gathered.replace_all_uses_with(gathered)
    graph.erase_node(host)
    erase_dead(graph, dead)
    return op


def _matmul_reduce_scatter(graph: Graph, match: MatmulReduceScatterMatch, inputs, mat2s, bias) -> Node:
    out_dtype = [match.out_dtype] if match.out_dtype is not None else []
    return call(
        graph,
        torch.ops.overlap.matmul_reduce_scatter.default,
        (inputs, mat2s, bias, match.reduce_op, match.scatter_dim, match.world_size, match.group_name, *out_dtype),
    )


def _scaled_matmul_reduce_scatter(graph: Graph, match: MatmulReduceScatterMatch, inputs, mat2s, bias) -> Node:
    """The overlap.scaled_matmul_reduce_scatter call of a float8 match: each rowwise input
    scale in its input's (scattered) layout."""
    scales = []
    for term, a in zip(match.terms, inputs):
        scale = term.input_scale
        if scale.meta["val"].numel() > 1:
            scale = reshape(graph, scale, [*a.meta["val"].shape[:-1], 1])
        scales.append(scale)
    return call(
        graph,
        torch.ops.overlap.scaled_matmul_reduce_scatter.default,
        (
            inputs, scales, mat2s, [t.mat2_scale for t in match.terms], bias, match.reduce_op,
            match.scatter_dim, match.world_size, match.group_name, match.scaled.out_dtype,
            match.out_dtype, match.scaled.use_fast_accum,
        ),
    )  # fmt: skip


def rewrite_matmul_reduce_scatter(graph: Graph, match: MatmulReduceScatterMatch) -> Node:
    """
        y = mm(a_1, w_1) (+ b_1) [+ mm(a_2, w_2) (+ b_2) ...]   (through reshapes, casts;
                 a term may be bmm(a_i, expand(w_i)) (+ b_i), a_i's rows in blocks)
        z = wait(reduce_scatter([split(scatter_dim) -> cat | movedim(scatter_dim, 0)] reshape(y)))
    becomes
        z = overlap.matmul_reduce_scatter([reshape(a_i)], [w_i], sum(b_i), reduce_op, ...,
                                          out_dtype=z's dtype where casts widened the terms)
            [-> movedim(scatter_dim, 0), a view, where the collective's input was moved so]
    """
    order = graph_order(graph)
    last_mm = max((term.mm for term in match.terms), key=order.__getitem__)
    dead = _chain(match.wait, match.scattered) + list(match.between) + [t.mm for t in match.terms]
    scattered_shape = match.scattered.meta["val"].shape
    with graph.inserting_before(last_mm):
        terms = []
        for term in match.terms:
            matrix_operands, batched = _matrix_operands(graph, term.mm)
            terms.append(matrix_operands)
            dead += batched
        inputs = [
            reshape(graph, rows, list(scattered_shape[:-1]) + [rows.meta["val"].shape[-1]])
            for rows, _, _ in terms
        ]
        bias = None
        for (_, _, term_bias), term in zip(terms, match.terms):
            term_bias = term.bias if term_bias is None else term_bias  # one added after the matmul
            if term_bias is not None:
                bias = term_bias if bias is None else call(graph, aten.add.Tensor, (bias, term_bias))
        make = _matmul_reduce_scatter if match.scaled is None else _scaled_matmul_reduce_scatter
        op = make(graph, match, inputs, [mat2 for _, mat2, _ in terms], bias)
        result = op if match.moved is None else call(graph, aten.permute.default, (op, list(match.moved)))
    match.wait.replace_all_uses_with(result)
    erase_dead(graph, dead)
    return op


CYCLE = "its op would read a value computed from its own result (through another rewrite)"


def rewrite_accepted(graph: Graph, decisions: list[tuple[Candidate, Decision]]) -> None:
    """Rewrites the accepted candidates one by one, keeping the graph sorted after each; a
    decision names the op it became. A candidate whose op would read its own result (through
    rewrites done before it) is skipped with its reason."""
    # Reduce-scatters first: their ops read a matmul that an all-gather op may replace next,
    # and the replacement then updates them (rewrite_all_gather_matmul).
    for candidate, decision in sorted(decisions, key=lambda d: d[0].kind == ALL_GATHER_MATMUL):
        if not decision.rewritten:
            continue
        if would_create_cycle(candidate.match):
            decision.skip(CYCLE)
            continue
        if isinstance(candidate.match, AllGatherMatmulMatch):
            op = rewrite_all_gather_matmul(graph, candidate.match)
        else:
            op = rewrite_matmul_reduce_scatter(graph, candidate.match)
        decision.op = op.name
        stable_topological_sort(graph)
