"""The fused TMA kernels compiled for Hopper (sm_90a) without a GPU, and what their IR says.

    python3 -m tests.kernel_ir            # a table: each kernel variant's pipelining, stores, smem,
                                          # registers and spills (ptxas)
    python3 -m tests.kernel_ir --json     # the same as JSON, one object per variant
    python3 -m tests.kernel_ir --pingpong # the Gluon float8 consumer's, as JSON
    python3 -m tests.kernel_ir --pingpong-producer  # the Gluon float8 producer's, as JSON

Hardware: any machine, GPU or not (Triton compiles for sm_90a without one). Not under
TRITON_INTERPRET=1, which makes kernels uncompilable: the CPU test runs this apart.

Triton compiles for a GPU target it is told of, GPU or not, so whether a loop was software
pipelined, whether stores vectorized and how much shared memory a kernel takes can be checked on
any machine. Regressions of both kinds were found this way (an atomic under a branch of the tile
loop, a CTA barrier in it, an alignment hint on an integer: each silently cost 5 to 70% on an
H100); tests/cpu/test_kernel_ir.py keeps them out.
"""

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory a Hopper block may take
_NOT_16 = ("rank", "world_size", "num_programs", "outer")  # ints the JIT rarely sees 16-divisible


@dataclasses.dataclass(frozen=True)
class KernelIR:
    name: str
    tma_loads: int  # TMA load ops in the TTGIR: the loop body's 2, and a prologue's if pipelined
    flattened: bool  # the tile loop fused into the K loop
    pipelined: bool  # loads issued ahead of the dot
    stores: dict  # PTX global store instructions by kind
    shared_bytes: int
    registers: int  # per thread, as ptxas allocates them
    spill_bytes: int  # stored to local memory by ptxas for want of registers


def _aligned_attrs(signature: dict) -> dict:
    """As the JIT specializes the shapes we run: pointers 16-byte aligned, ints 16-divisible."""
    attrs = {}
    for i, (name, ty) in enumerate(signature.items()):
        for j, t in enumerate(ty if isinstance(ty, tuple) else (ty,)):
            path = (i, j) if isinstance(ty, tuple) else (i,)
            if t.startswith("*") or (t == "i32" and name not in _NOT_16):
                attrs[path] = [["tt.divisibility", 16]]
    return attrs


def compile_hopper(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    source = ASTSource(fn, signature, constexprs, _aligned_attrs(signature))
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


# the loop that Triton's flattening makes: unit steps over every (tile, K block) of the
# program, the accumulator carried (the K loops step by BLOCK_K)
_FLATTENED_LOOP = re.compile(r"scf\.for [^\n]* step %c1_i32 iter_args\([^\n]*tensor<\d+x\d+xf32, #mma>")


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) as ``ptxas -v`` reports them for sm_90a."""
    from triton.backends.nvidia import compiler as nvidia

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        done = subprocess.run(
            [nvidia.get_ptxas(HOPPER.arch).path, "-v", f"--gpu-name=sm_{HOPPER.arch}a", source.name, "-o", "/dev/null"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = done.stdout + done.stderr
    return int(re.search(r"Used (\d+) registers", report)[1]), int(re.search(r"(\d+) bytes spill stores", report)[1])


def summarize(name: str, kernel) -> KernelIR:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    loads = ttgir.count("ttng.async_tma_copy_global_to_local")
    registers, spill_bytes = _ptxas_usage(ptx)
    return KernelIR(
        name=name,
        tma_loads=loads,
        flattened=bool(_FLATTENED_LOOP.search(ttgir)),
        pipelined=loads > 2,  # more than the loop body's own two: a prologue loads ahead
        stores=dict(collections.Counter(re.findall(r"st\.global[a-z0-9.:]*", ptx))),
        shared_bytes=kernel.metadata.shared,
        registers=registers,
        spill_bytes=spill_bytes,
    )


def _dtype_name(float8: bool) -> str:
    return "fp8e4nv" if float8 else "bf16"


def consumer_ir(float8: bool, num_b: int = 1, exact: bool = False, config=None) -> KernelIR:
    """The all-gather consumer's TMA kernel over ``num_b`` weights ([N, K] layout), bf16 out;
    float8 with rowwise scales."""
    config = config or (gemm.FLOAT8_CONFIGS[0] if float8 else gemm.CONFIGS[0])
    dt, bm, bn, bk = _dtype_name(float8), config.block_m, config.block_n, config.block_k
    signature = {"a_desc": f"tensordesc<{dt}[{bm}, {bk}]>", "a_local_desc": f"tensordesc<{dt}[{bm}, {bk}]>"}
    signature.update({f"b_desc{i}": f"tensordesc<{dt}[{bn}, {bk}]>" for i in range(consumer.MAX_B)})
    many = lambda t: tuple([t] * num_b)  # noqa: E731
    signature.update({
        "bias_ptrs": many("*bf16"), "c_ptrs": many("*bf16"), "Ns": many("i32"), "strides_cm": many("i32"),
        "flags_ptr": "*i32", "epoch_ptr": "*i32", "timeouts_ptr": "*i32", "outer": "i32", "inner": "i32",
        "K": "i32", "rank": "i32", "world_size": "i32", "num_programs": "i32", "a_scale_ptr": "*fp32",
        "a_local_scale_ptr": "*fp32", "b_scale_ptrs": many("*fp32"),
    })  # fmt: skip
    mask = (1 << num_b) - 1 if float8 else 0
    constexprs = dict(
        BIAS_MASK=0, A_SCALE=2 if float8 else 0, B_SCALE_MASK=mask, B_ROWWISE_MASK=mask, B_NK=True,
        FP8_EXACT=exact, FLATTEN=gemm.flatten_tiles(exact, [torch.bfloat16]),
        PIPELINED_WAIT=True, SPIN_LIMIT=1 << 30, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
    )  # fmt: skip
    kernel = compile_hopper(consumer.all_gather_matmul_tma_kernel, signature, constexprs, config.num_warps, config.num_stages)
    return summarize(f"consumer {dt} B={num_b}{' exact' if exact else ''} {config}", kernel)


def producer_ir(float8: bool, exact: bool = False, config=None, world: int = 4) -> KernelIR:
    """The reduce-scatter producer's TMA kernel, bf16 partials, summing its own chunk into a
    bf16 output in its epilogue at ``world`` ranks, as the ops launch it (0: without the sum);
    float8 with rowwise scales."""
    config = config or (gemm.FLOAT8_CONFIGS[0] if float8 else gemm.CONFIGS[0])
    dt, bm, bn, bk = _dtype_name(float8), config.block_m, config.block_n, config.block_k
    signature = {
        "a_desc": f"tensordesc<{dt}[{bm}, {bk}]>", "b_desc": f"tensordesc<{dt}[{bn}, {bk}]>", "bias_ptr": "*bf16",
        "dest_ptrs_ptr": "*i64", "flag_ptrs_ptr": "*i64", "counters_ptr": "*i32", "epoch_ptr": "*i32",
        "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "out_ptr": "*bf16", "flags_ptr": "*i32",
        "timeouts_ptr": "*i32", "scale": "fp32", "outer": "i32", "inner": "i32", "N": "i32", "K": "i32",
        "rank": "i32", "world_size": "i32", "num_programs": "i32",
    }  # fmt: skip
    constexprs = dict(
        HAS_BIAS=False, REDUCE_WORLD=world, SPIN_LIMIT=1 << 30, PIPELINED_WAIT=True, A_SCALE=2 if float8 else 0, B_SCALE=2 if float8 else 0, OUT_DTYPE=tl.bfloat16, B_NK=True,
        FP8_EXACT=exact, FLATTEN=gemm.flatten_tiles(exact, [torch.bfloat16]), PTX_BARRIER=True, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
    )  # fmt: skip
    kernel = compile_hopper(producer.matmul_reduce_scatter_tma_kernel, signature, constexprs, config.num_warps, config.num_stages)
    reduced = f" W={world}" if world else " no sum"
    return summarize(f"producer {dt}{' exact' if exact else ''}{reduced} {config}", kernel)


def pingpong_ir(config, rowwise: bool, num_b: int = 1, exact: bool = False) -> dict:
    """The Gluon float8 consumer (templates/all_gather_matmul_pingpong.py) over ``num_b``
    weights (``exact``: its cooperative exact-accumulation form), compiled for sm_90a: what its
    waits and speed rest on, as counts in its PTX."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from overlap_pass.templates import all_gather_matmul_pingpong as pingpong

    tile = pingpong.TILE
    layout = gl.NVMMASharedLayout.get_default_for([tile, tile], gl.float8e4nv)
    desc = f"tensordesc<fp8e4nv[{tile}, {tile}],{layout!r}>"
    many = lambda t: tuple([t] * num_b)  # noqa: E731
    signature = {"a_desc": desc, "a_local_desc": desc}
    signature.update({f"b_desc{i}": desc for i in range(pingpong.MAX_B)})
    signature.update({
        "c_ptrs": many("*bf16"), "strides_cm": many("i32"), "bias_ptrs": many("*bf16"), "a_scale_ptr": "*fp32",
        "a_local_scale_ptr": "*fp32", "b_scale_ptrs": many("*fp32"), "flags_ptr": "*i32", "epoch_ptr": "*i32",
        "timeouts_ptr": "*i32", "outer": "i32", "inner": "i32", "Ns": many("i32"), "K": "i32", "rank": "i32",
        "world_size": "i32",
    })  # fmt: skip
    constexprs = dict(
        A_SCALE=2 if rowwise else 1, B_ROWWISE_MASK=(1 << num_b) - 1 if rowwise else 0, BIAS_MASK=0,
        NUM_STAGES=config.stages, GROUP_M=config.group_m, SPIN_LIMIT=1 << 30, EXACT=exact,
    )  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    source = GluonASTSource(pingpong.all_gather_matmul_pingpong_kernel, signature, constexprs, _aligned_attrs(signature))
    kernel = triton.compile(source, target=HOPPER, options={"num_warps": 4, "maxnreg": pingpong.MAXNREG})
    what = f"pingpong {config} {'rowwise' if rowwise else 'tensorwise'}{' exact' if exact else ''} B={num_b}"
    return _gluon_counts(what, kernel)


def pingpong_producer_ir(config, rowwise: bool, terms: int = 1, exact: bool = False) -> dict:
    """The Gluon float8 reduce-scatter producer (templates/matmul_reduce_scatter_pingpong.py)
    over a sum of ``terms`` matmuls (``exact``, or a sum: its cooperative form), compiled for
    sm_90a, as pingpong_ir counts it, with its publishing: the warpgroups' barriers (named, 128
    threads each: a CTA-wide one would wait for the other partitions) and the system-scope
    counter adds and flag writes."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from overlap_pass.templates import matmul_reduce_scatter_pingpong as producer_pp

    tile = producer_pp.TILE
    layout = gl.NVMMASharedLayout.get_default_for([tile, tile], gl.float8e4nv)
    desc = f"tensordesc<fp8e4nv[{tile}, {tile}],{layout!r}>"
    many = lambda t: tuple([t] * terms)  # noqa: E731
    signature = {f"{ab}_desc{i}": desc for ab in "ab" for i in range(producer_pp.MAX_TERMS)}
    signature.update({
        "dest_ptrs_ptr": "*i64", "flag_ptrs_ptr": "*i64", "counters_ptr": "*i32", "epoch_ptr": "*i32",
        "bias_ptr": "*bf16", "a_scale_ptrs": many("*fp32"), "b_scale_ptrs": many("*fp32"), "outer": "i32",
        "inner": "i32", "N": "i32", "Ks": many("i32"), "rank": "i32", "world_size": "i32",
    })  # fmt: skip
    mask = (1 << terms) - 1 if rowwise else 0
    constexprs = dict(
        A_ROWWISE_MASK=mask, B_ROWWISE_MASK=mask, HAS_BIAS=False, OUT_DTYPE=gl.bfloat16,
        NUM_STAGES=config.stages, GROUP_M=config.group_m, COOPERATIVE=exact or terms > 1,
    )  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    source = GluonASTSource(producer_pp.matmul_reduce_scatter_pingpong_kernel, signature, constexprs, _aligned_attrs(signature))
    kernel = triton.compile(source, target=HOPPER, options={"num_warps": 4, "maxnreg": producer_pp.MAXNREG})
    ptx = kernel.asm["ptx"]
    scales = "rowwise" if rowwise else "tensorwise"
    what = f"pingpong producer {config} {scales}{' exact' if exact else ''} terms={terms}"
    return {
        **_gluon_counts(what, kernel),
        "barriers": sorted(set(re.findall(r"bar\.sync\s+[^;]*;", ptx))),
        "counter_adds": len(re.findall(r"atom\.global\.sys\.acq_rel\.add", ptx)),
        "flag_writes": len(re.findall(r"atom\.global\.sys\.release\.exch", ptx)),
    }


def _gluon_counts(what: str, kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {
        "what": what,
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "setmaxnreg": sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "flag_polls": len(re.findall(r"ld\.global\.sys\.acquire\.b32", ptx)),
        "async_fences": ptx.count("fence.proxy.async.global"),
        "stores": dict(collections.Counter(re.findall(r"st\.global[a-z0-9.:]*", ptx))),
        "shared_bytes": kernel.metadata.shared,
    }


def variants() -> list:
    """(what, function of no arguments) for every TMA kernel variant the ops launch: each config
    of the bf16 and float8 lists, three weights in one consumer launch, exact accumulation."""
    tma = [c for c in gemm.CONFIGS if c.tma]
    runs = [(f"consumer bf16 {c}", lambda c=c: consumer_ir(False, config=c)) for c in tma]
    runs += [(f"consumer float8 {c}", lambda c=c: consumer_ir(True, config=c)) for c in gemm.FLOAT8_CONFIGS]
    runs += [(f"producer bf16 {c}", lambda c=c: producer_ir(False, config=c)) for c in tma]
    runs += [(f"producer float8 {c}", lambda c=c: producer_ir(True, config=c)) for c in gemm.FLOAT8_CONFIGS]
    runs += [
        ("producer bf16, W=2", lambda: producer_ir(False, world=2)),
        ("consumer bf16, three weights", lambda: consumer_ir(False, num_b=3)),
        ("consumer float8, exact", lambda: consumer_ir(True, exact=True)),
        ("producer float8, exact", lambda: producer_ir(True, exact=True)),
    ]
    return runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="the table as JSON, one object per variant")
    parser.add_argument("--pingpong", action="store_true", help="the Gluon float8 consumer's configs instead (JSON)")
    parser.add_argument("--pingpong-producer", action="store_true", help="the Gluon float8 producer's configs instead (JSON)")
    args = parser.parse_args(argv)
    if args.pingpong and not args.pingpong_producer:  # JSON, one object per config and scale kind
        from overlap_pass.templates import all_gather_matmul_pingpong as pingpong

        runs = [(c, rowwise, 1) for c in pingpong.CONFIGS for rowwise in (False, True)] + [(pingpong.CONFIGS[0], True, 3)]
        runs += [(c, True, 2, True) for c in pingpong.CONFIGS]  # exact accumulation
        print(json.dumps([pingpong_ir(*run) for run in runs]))
        return
    if args.pingpong_producer:
        from overlap_pass.templates import matmul_reduce_scatter_pingpong as producer_pp

        runs = [(c, rowwise) for c in producer_pp.CONFIGS for rowwise in (False, True)]
        runs += [(producer_pp.CONFIGS[0], True, 1, True), (producer_pp.CONFIGS[0], True, 3, True)]  # exact; Q+K+V
        print(json.dumps([pingpong_producer_ir(*run) for run in runs]))
        return
    runs = variants()
    rows = [run() for _, run in runs]
    if args.json:
        print(json.dumps([{"what": what, **dataclasses.asdict(r)} for (what, _), r in zip(runs, rows)]))
        return
    print("| kernel | flattened | pipelined | TMA loads | stores | shared memory | registers | spilled bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.name} | {r.flattened} | {r.pipelined} | {r.tma_loads} | {r.stores} | {r.shared_bytes} "
            f"| {r.registers} | {r.spill_bytes} |"
        )


if __name__ == "__main__":
    main()
