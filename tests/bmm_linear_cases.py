"""Tensor-parallel linears written as batched matmuls: NeMo Automodel's form and einsum's.

NeMo Automodel runs its tensor-parallel linears under torch.compile as
``torch.bmm(x, weight.t().unsqueeze(0).expand(B, -1, -1))`` on [B, S, D] activations (F.linear's
view cannot flatten a sequence-sharded DTensor); users also write
``torch.einsum("bsd,nd->bsn", x, weight)``, which lowers to a bmm of batch 1 between views that
move dims of size 1. Both are one matmul over the flattened rows, so the pass takes them as it
takes F.linear's mm (matmul_checks.shared_matrix, batch_sum).

The forms by name (``FORMS``):
- "bmm": NeMo Automodel's compiled forward, reproduced (``BmmLinear``);
- "einsum": ``EinsumLinear``;
- "nemo": NeMo Automodel's own TPLinear and its plan styles, where the package is installed.

The gloo bodies below run on each rank of a RankPool (tests/rank_pool.py).
"""

import importlib.util

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from benchmarks.tp_models import TransformerBlock

FORMS = ("bmm", "einsum", "nemo")
NEMO_STYLES = "nemo_automodel.components.distributed.parallel_styles"


def nemo_installed() -> bool:
    """Whether NeMo Automodel's parallel styles can be imported (``pip install --no-deps
    nemo-automodel``: its TP linear needs only torch and packaging)."""
    try:
        return importlib.util.find_spec(NEMO_STYLES) is not None
    except ModuleNotFoundError:
        return False


class BmmLinear(nn.Linear):
    """The compiled forward of NeMo Automodel's TPLinear (nemo-automodel 0.7.0,
    nemo_automodel/shared/tp_linear.py, ``tp_linear_forward``, the branch every torch.compile
    trace of a 3-D input takes unless Inductor's async TP is on): a bmm against the weight
    transposed, unsqueezed and expanded over the batch, the bias added after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.bmm(x, self.weight.t().unsqueeze(0).expand(x.shape[0], -1, -1))
        return out + self.bias if self.bias is not None else out


class EinsumLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("bsd,nd->bsn", x, self.weight)
        return out + self.bias if self.bias is not None else out


def _swapping(style: type, linear: type) -> type:
    """``style`` that turns the nn.Linear it shards into ``linear``, as NeMo Automodel's
    ColwiseParallelLora and RowwiseParallelLora turn it into TPLinear."""

    class Swapping(style):
        def _partition_linear_fn(self, name, module, device_mesh):
            super()._partition_linear_fn(name, module, device_mesh)
            if type(module) is nn.Linear:
                module.__class__ = linear

    return Swapping


def _styles(form: str) -> tuple[type, type]:
    if form == "nemo":
        styles = importlib.import_module(NEMO_STYLES)
        return styles.ColwiseParallelLora, styles.RowwiseParallelLora
    linear = {"bmm": BmmLinear, "einsum": EinsumLinear}[form]
    return _swapping(ColwiseParallel, linear), _swapping(RowwiseParallel, linear)


def parallelize_block(block: TransformerBlock, mesh, form: str) -> TransformerBlock:
    """Megatron TP + sequence parallel as benchmarks/tp_models.py's plan (the block takes and returns
    [batch, seq / W, dim]), each linear in ``form``."""
    colwise, rowwise = _styles(form)
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"attention": gathered, "feed_forward": gathered}
    plan |= {f"attention.{name}": colwise() for name in ("q", "k", "v")}
    plan |= {f"feed_forward.{name}": colwise() for name in ("gate", "up")}
    plan |= {name: rowwise(output_layouts=Shard(1)) for name in ("attention.o", "feed_forward.down")}
    return parallelize_module(block, mesh, plan)


def block(form: str, world_size: int, bias: bool = False, dim: int = 32) -> TransformerBlock:
    from torch.distributed.device_mesh import init_device_mesh

    model = TransformerBlock(dim=dim, heads=max(4, world_size), hidden=16 * world_size, bias=bias)
    return parallelize_block(model, init_device_mesh("cpu", (world_size,)), form)


# ---------------------------------------------------------------------------------------------
# hand-written sequence parallelism with the same linears (functional collectives)


def _linear(x, w, form: str):
    if form == "einsum":
        return torch.einsum("bsd,nd->bsn", x, w)
    return torch.bmm(x, w.t().unsqueeze(0).expand(x.shape[0], -1, -1))


def sp_mlp(x, w_up, w_down, group, form: str, checkpointed: bool = False):
    """[B, S / W, D] -> gather along seq -> up -> gelu -> down -> reduce-scatter along seq;
    ``checkpointed``: the gathered input and up are recomputed in the backward (the partitioner
    recomputes up's output for gelu's grad rather than save it), so up's weight grad (a bmm of
    the gathered rows transposed, summed over the batch) contracts them with a value computed
    from them."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    def up(x, w_up):
        return _linear(funcol.all_gather_tensor_autograd(x, 1, group), w_up, form)

    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        hidden = F.gelu(checkpoint(up, x, w_up, use_reentrant=False))
    else:
        hidden = F.gelu(up(x, w_up))
    return funcol.reduce_scatter_tensor_autograd(_linear(hidden, w_down, form), "sum", 1, group)


def contractions(x, y, z, w, group, form: str):
    """The gathered rows contracted on either side, per batch element and summed over the
    batch (a weight gradient written by hand): g^T @ y and z @ g, with a linear of g."""
    import torch.distributed._functional_collectives as funcol

    g = funcol.all_gather_tensor(x, 1, group)
    left = torch.bmm(g.transpose(1, 2), y).sum(0)
    right = torch.bmm(z, g).sum(0)
    return left, right, _linear(g, w, form)


# ---------------------------------------------------------------------------------------------
# gloo bodies


def _numerics():
    from tests.cpu import numerics_cases

    return numerics_cases


def training_block(form: str, batch: int, bias: bool = False, seed: int = 0) -> list[tuple]:
    """The block in ``form``, compiled with backend="overlap", against the same block eager:
    outputs, input and parameter grads at fp32 tolerance, two steps. Returns the decisions."""
    cases = _numerics()

    @cases._decided
    def run():
        torch.manual_seed(seed)  # the same full weights on every rank
        model = block(form, dist.get_world_size(), bias)
        seq = 4 * dist.get_world_size()
        cases._compare_module(model, lambda: torch.randn(batch, seq // dist.get_world_size(), 32), seed)

    return run()


def training_sp_mlp(form: str, batch: int, checkpointed: bool, seed: int = 0) -> list[tuple]:
    """sp_mlp compiled against eager: output, input and weight grads at fp32 tolerance."""
    cases = _numerics()

    @cases._decided
    def run():
        group = dist.group.WORLD.group_name
        torch.manual_seed(seed)  # the same full weights on every rank
        w_up, w_down = torch.randn(16, 8), torch.randn(8, 16)
        torch.manual_seed(seed + 1000 * dist.get_rank())
        x = torch.randn(batch, 3, 8)
        grad = torch.randn(batch, 3, 8)
        results = []
        for fn in (sp_mlp, torch.compile(sp_mlp, backend="overlap", fullgraph=True)):
            leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
            out = fn(*leaves, group, form, checkpointed)
            out.backward(grad)
            results.append([out.detach()] + [t.grad for t in leaves])
        for got, want, name in zip(*results, ("out", "x", "w_up", "w_down")):
            torch.testing.assert_close(got, want, **cases.TOL, msg=name)

    return run()


def contractions_match(form: str, seed: int = 0) -> list[tuple]:
    """``contractions`` compiled against eager, each rank with its own inputs."""
    cases = _numerics()

    @cases._decided
    def run():
        world, group = dist.get_world_size(), dist.group.WORLD.group_name
        torch.manual_seed(seed + 1000 * dist.get_rank())
        x, w = torch.randn(2, 3, 5), torch.randn(6, 5)
        y, z = torch.randn(2, 3 * world, 4), torch.randn(2, 7, 3 * world)
        compiled = torch.compile(contractions, backend="overlap", fullgraph=True)
        for got, want in zip(compiled(x, y, z, w, group, form), contractions(x, y, z, w, group, form)):
            torch.testing.assert_close(got, want, **cases.TOL)

    return run()
