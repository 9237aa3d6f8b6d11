"""An emulated NCCL collective's hold on rank 0's GPU: a kernel of ``nccl_sms`` programs, as
NCCL's kernel holds that many SMs (a CTA per channel), each holding its SM until NCCL's time for
the collective has passed since the collective began (a stamp taken before its values were
written, nccl.py). One kernel per collective, named so that a profile tells them apart
(benchmarks/exposed_time.py)."""

import triton.language as tl

from overlap_pass.templates.launch import DirectKernel

from .pacing import _wait_until, ns, unspecialized


@unspecialized(("slot", "duration_ns"), ("stamps_ptr",))
def emulated_nccl_all_gather(stamps_ptr, slot, duration_ns):
    _wait_until(tl.load(stamps_ptr + slot) + duration_ns)


@unspecialized(("slot", "duration_ns"), ("stamps_ptr",))
def emulated_nccl_reduce_scatter(stamps_ptr, slot, duration_ns):
    _wait_until(tl.load(stamps_ptr + slot) + duration_ns)


@unspecialized(("slot", "duration_ns"), ("stamps_ptr",))
def emulated_nccl_all_reduce(stamps_ptr, slot, duration_ns):
    _wait_until(tl.load(stamps_ptr + slot) + duration_ns)


@unspecialized(("slot", "duration_ns"), ("stamps_ptr",))
def emulated_nccl_other(stamps_ptr, slot, duration_ns):
    _wait_until(tl.load(stamps_ptr + slot) + duration_ns)


HOLDS = {
    "all_gather": DirectKernel(emulated_nccl_all_gather), "reduce_scatter": DirectKernel(emulated_nccl_reduce_scatter),
    "all_reduce": DirectKernel(emulated_nccl_all_reduce),
}  # fmt: skip
OTHER = DirectKernel(emulated_nccl_other)


def hold(collective: str, stamps, slot: int, duration_us: float, sms: int) -> None:
    """On the current stream: ``sms`` programs held until ``duration_us`` after stamps[slot]."""
    HOLDS.get(collective, OTHER)[(max(1, sms),)](stamps, slot, ns(duration_us), num_warps=1)


def preload(device) -> None:
    """Compiles and loads the holds (pacing.preload says why), holding nothing."""
    import torch

    stamps = torch.zeros(1, dtype=torch.int64, device=device)
    for kernel in (*HOLDS.values(), OTHER):
        kernel[(1,)](stamps, 0, 0, num_warps=1)
    torch.cuda.synchronize(device)
