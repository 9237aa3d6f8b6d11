"""One GPU: cuBLAS on a chunk of several runs of rows (lowering/row_layout.py) against the same
rows contiguous. Llama 3 8B shapes at batch 4, 8192 tokens a sequence, W=2: a chunk is 4 runs
of 4096 rows. Prints µs per call (median of do_bench) and the batched call's error."""
import torch
from triton.testing import do_bench

from overlap_pass.lowering.row_layout import RowLayout, matmul_into

torch.manual_seed(0)
world, outer, inner = 2, 4, 4096
rows = []
for name, k, n in (("qkv", 4096, 3072), ("o", 2048, 4096), ("up+gate", 4096, 14336), ("down", 7168, 4096)):
    layout = RowLayout(outer, world, inner)
    a = torch.randn(world * outer * inner, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    out = torch.empty(world * outer * inner, n, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(outer * inner, n, device="cuda", dtype=torch.bfloat16)
    contiguous = a[: outer * inner]
    t_mm = do_bench(lambda: torch.mm(contiguous, w.t(), out=part), return_mode="median") * 1e3
    t_strided_in = do_bench(lambda: matmul_into(layout.chunk(a, 1), w.t(), None, layout.own(part)), return_mode="median") * 1e3
    t_strided_out = do_bench(lambda: matmul_into(layout.own(contiguous), w.t(), None, layout.chunk(out, 1)), return_mode="median") * 1e3
    def per_block():
        for b in range(outer):
            torch.mm(a[slice(*layout.block_span(1, b))], w.t(), out=part[b * inner : (b + 1) * inner])
    t_loop = do_bench(per_block, return_mode="median") * 1e3
    matmul_into(layout.chunk(a, 1), w.t(), None, layout.own(part))
    ref = layout.chunk(a, 1).reshape(-1, k).float() @ w.float().t()
    err = ((part.float() - ref).norm() / ref.norm()).item()
    rows.append((name, k, n, t_mm, t_strided_in, t_strided_out, t_loop, err))
print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
print("| shape | K | N | mm, contiguous rows | bmm, chunk in (RS) | bmm, chunk out (AG) | 4 mm per block | bmm rel. error |")
print("|---|---|---|---|---|---|---|---|")
for name, k, n, *t, err in rows:
    print(f"| {name} | {k} | {n} | " + " | ".join(f"{x:.0f}" for x in t) + f" | {err:.1e} |")
