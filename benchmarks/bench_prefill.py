"""Hugging Face Llama with its own tensor-parallel plan (``tp_plan``: plain TP, an all-reduce after
each row-parallel linear): prefill at prompt lengths that change from call to call, and
decode-shaped calls, each backend compiling the model once; plain Inductor against
backend="overlap" (and overlap under config patches, --backends: benchmarks/bench_model.py's
EXTRA_COMPILERS), in one process on the same inputs.

    torchrun --nproc-per-node 4 -m benchmarks.bench_prefill --lengths 128,1001,2048,4095,8192 --out prefill.json

The model: LlamaConfig at Llama 3 8B widths (--size), --layers decoder layers, --vocab tokens,
random weights saved by rank 0 and loaded on every rank with ``DistributedConfig(tp_size=W)``, as
users load a checkpoint; bf16, eval, no grad. Each backend is called at every length in the
order given (batch --batch): the first length compiles a static graph, the second a symbolic one
(automatic dynamic) that serves every later length; where W does not divide a length's tokens,
the split all-reduces run on padded shards. Decode-shaped calls (--decode-batch sequences of one
token, no KV cache) run the linears at a decode step's shapes, where a fused op cannot pay and
the per-shape choice keeps NCCL + cuBLAS.

Per length, each backend's first call is timed alone (a compile, or the symbolic graph's first
call at that count, whose token bucket may be measured), and its logits are checked against the
eager model's; then the backends' calls are timed interleaved (benchmarks/measure.py): the slowest
rank's median over rounds of --calls calls, each round opened by --settle untimed calls. Printed
last: a table, a row per length and overlap backend, with the overlap op calls of one of its
prefills (0: nothing fused) and the host time to queue a call.
"""

import argparse
import functools
import json
import os
import tempfile
import time

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.bench_model import EXTRA_COMPILERS, _compile, _config_of  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    OVERLAP_OPS, add_settle_argument, overlap_op_calls, relative_error, slowest, time_interleaved,
)

# (hidden, heads, K/V heads, FFN)
SIZES = {"llama3-8b": (4096, 32, 8, 14336), "llama3-70b": (8192, 64, 8, 28672), "small": (1024, 8, 8, 3584)}
BACKENDS = ("inductor", "overlap", *EXTRA_COMPILERS)
TOLERANCE = 3e-2  # bf16 logits through --layers layers, summed in another order than eager's


def _save(folder: str, size: str, layers: int, vocab: int, positions: int, device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, ffn = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def saved_model(size: str, layers: int, vocab: int, positions: int, device) -> str:
    """A Llama of ``size`` widths with random weights, saved by rank 0 in a temporary folder (as
    a checkpoint users load); the folder's path, on every rank."""
    rank = dist.get_rank()
    shared = [tempfile.mkdtemp(prefix="overlap-llama-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    if rank == 0:
        _save(shared[0], size, layers, vocab, positions, device)
    dist.barrier()
    return shared[0]


def load_model(folder: str, device, train: bool = False):
    """The saved Llama, loaded with its own tp_plan over every rank (DistributedConfig)."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    model = LlamaForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=dist.get_world_size()), dtype=torch.bfloat16
    )
    return model.to(device).train(train)


def _overlap_calls(run) -> int:
    """The overlap op calls one ``run()`` makes."""
    with overlap_op_calls() as counts:
        run()
        torch.cuda.synchronize()
    return sum(counts[name] for name in OVERLAP_OPS)


def _call(backend: str, model, ids):
    with _config_of(backend):  # (compiles under the backend's config at a new length)
        return model(input_ids=ids)


def _first_call(run, device) -> float:
    """One call's wall time in ms, the GPU idle before and after (slowest rank)."""
    torch.cuda.synchronize(device)
    dist.barrier()
    begin = time.perf_counter()
    run()
    torch.cuda.synchronize(device)
    return slowest((time.perf_counter() - begin) * 1e3, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--lengths", default="128,1001,2048,4095,8192", help="prompt lengths, in call order")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode-batch", type=int, default=8, help="decode-shaped calls: sequences of 1 token (0: none)")
    parser.add_argument("--size", choices=sorted(SIZES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    add_settle_argument(parser)
    parser.add_argument(
        "--backends", default="inductor,overlap",
        help=f"inductor first, then any of {','.join(BACKENDS[1:])} (overlap with a config patch: benchmarks/bench_model.py)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench_prefill.json")
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    if args.backends[0] != "inductor" or not set(args.backends) <= set(BACKENDS):
        parser.error(f"--backends: inductor first, then any of {','.join(BACKENDS[1:])}")
    args.lengths = [int(n) for n in args.lengths.split(",")]

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    folder = saved_model(args.size, args.layers, args.vocab, max(args.lengths) + 1, device)
    eager = load_model(folder, device)
    compiled = {b: _compile(load_model(folder, device), b) for b in args.backends}

    shapes = [(args.batch, n) for n in args.lengths]
    if args.decode_batch:
        shapes.append((args.decode_batch, 1))
    rows = []
    with torch.no_grad():
        for batch, length in shapes:
            gen = torch.Generator(device=device).manual_seed(length)  # the same prompt on every rank
            ids = torch.randint(0, args.vocab, (batch, length), device=device, generator=gen)
            reference = eager(input_ids=ids).logits
            runners = {b: functools.partial(_call, b, m, ids) for b, m in compiled.items()}
            row = {"batch": batch, "length": length, "tokens": batch * length, "first_ms": {}, "error": {}}
            for backend, run in runners.items():
                row["first_ms"][backend] = _first_call(run, device)
                row["error"][backend] = relative_error(run().logits, reference)
            row["overlap_op_calls"] = {b: _overlap_calls(run) for b, run in runners.items() if b != "inductor"}
            us, host_us = time_interleaved(runners, device, args.rounds, args.calls, args.warmup, args.settle)
            row["us"], row["host_us"] = us, host_us
            rows.append(row)
            if rank == 0:
                print(f"{batch} x {length}: {us}", flush=True)
    if rank == 0:
        _report(args, world, rows)
    dist.destroy_process_group()


def _report(args, world: int, rows: list) -> None:
    print(f"\nHugging Face Llama ({args.size} widths, {args.layers} layers, vocab {args.vocab}), tp_plan, W={world}, "
          f"bf16, no grad; {torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    print("| batch x length | backend | overlap ops a call | Inductor µs | its µs | speedup | host µs: Inductor "
          "| its | first call ms: Inductor | its | logits' relative error: Inductor | its |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        us, host, first, error = r["us"], r["host_us"], r["first_ms"], r["error"]
        for b in args.backends[1:]:
            print(
                f"| {r['batch']} x {r['length']} | {b} | {r['overlap_op_calls'][b]} | {us['inductor']:.0f} | {us[b]:.0f} "
                f"| {us['inductor'] / us[b]:.2f}x | {host['inductor']:.0f} | {host[b]:.0f} | {first['inductor']:.0f} "
                f"| {first[b]:.0f} | {error['inductor']:.1e} | {error[b]:.1e} |"
            )
    bad = [r for r in rows if not all(e < TOLERANCE for e in r["error"].values())]  # NaN fails too
    print(f"logits within {TOLERANCE} of eager's: {len(rows) - len(bad)} of {len(rows)} shapes")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "world_size": world, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
