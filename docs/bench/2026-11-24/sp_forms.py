"""Which ways of writing a sequence-parallel all-gather along dim 1 compile into one graph."""
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
group = dist.group.WORLD
w = torch.randn(16, 8)

def gather_dim1(x):
    return funcol.all_gather_tensor(x, gather_dim=1, group=group) @ w

def gather_dim1_name(x):
    return funcol.all_gather_tensor(x, 1, group.group_name) @ w

def gather_dim0_movedim(x):
    g = funcol.all_gather_tensor(x.transpose(0, 1).contiguous(), gather_dim=0, group=group)
    return g.transpose(0, 1) @ w

def gather_dim0_cat(x):
    g = funcol.all_gather_tensor(x, gather_dim=0, group=group)
    return torch.cat(g.chunk(2, dim=0), dim=1) @ w

def reduce_scatter_dim1(x):
    return funcol.reduce_scatter_tensor(x @ w, "sum", scatter_dim=1, group=group)

def gather_dim1_autograd(x):
    return funcol.all_gather_tensor_autograd(x, gather_dim=1, group=group) @ w

for fn, grad in [(f, g) for g in (False, True) for f in (gather_dim1, gather_dim1_name, gather_dim0_movedim, gather_dim0_cat, reduce_scatter_dim1, gather_dim1_autograd)]:
    torch._dynamo.reset()
    x = torch.randn(4, 6, 16, requires_grad=grad)
    print(f"-- requires_grad={grad}")
    try:
        explain = torch._dynamo.explain(fn)(x)
        print(f"{torch.__version__} {fn.__name__}: graphs={explain.graph_count} breaks={explain.graph_break_count} "
              + "; ".join(str(b.reason).splitlines()[0][:160] for b in explain.break_reasons))
    except Exception as e:
        print(f"{torch.__version__} {fn.__name__}: error {type(e).__name__}: {str(e)[:200]}")
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        if grad and out.requires_grad:
            out.sum().backward()
        print(f"   fullgraph ok (aot_eager; output requires grad: {out.requires_grad})")
    except Exception as e:
        print(f"   fullgraph fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
dist.destroy_process_group()
