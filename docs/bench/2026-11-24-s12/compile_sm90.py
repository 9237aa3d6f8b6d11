"""Compile Triton kernels for sm_90 on a CPU machine and dump TTGIR, to see whether loops pipeline."""
import sys, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_kernel(fn, signature, constexprs, num_warps=8, num_stages=3, aligned=True):
    # as the JIT specializes our shapes: every pointer and int argument 16-divisible
    attrs = {}
    if aligned:
        for i, (name, ty) in enumerate(signature.items()):
            if isinstance(ty, tuple):
                for j, t in enumerate(ty):
                    if t.startswith("*") or t == "i32":
                        attrs[(i, j)] = [["tt.divisibility", 16]]
            elif ty.startswith("*") or ty == "i32":
                if name not in ("rank", "world_size", "num_programs", "outer"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    return k

def summarize(name, k):
    ttgir = k.asm["ttgir"]
    allocs = re.findall(r"ttg.local_alloc[^\n]*!ttg.memdesc<([0-9x]+)x(f8E4M3FN|bf16|f16)", ttgir)
    import collections
    stores = collections.Counter(re.findall(r"st\.global[a-z0-9.:]*", k.asm["ptx"]))
    print(name, dict(stores), "smem", k.metadata.shared, "regs", getattr(k, "n_regs", "?"),
          "| multibuf allocs", allocs,
          "| async dots", ttgir.count("isAsync = true"), "| dot_wait", ttgir.count("warp_group_dot_wait"),
          "| scf.for", ttgir.count("scf.for"), "| tma loads", ttgir.count("async_tma_copy_global_to_local"))
    return ttgir

def ptx_of(k):
    return k.asm["ptx"]
