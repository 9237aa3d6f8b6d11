"""The Gluon calls of the pingpong kernels whose names moved between the triton versions the
project runs on (3.6 on the GPU machines, 3.9 with torch 2.15): one name each, bound to what
the installed package offers (not decided by its version string).

- The TMA load of a block from global into shared memory, arriving on an mbarrier:
  ``tma.async_copy_global_to_shared(desc, coord, barrier, smem)`` in 3.6,
  ``tma.async_load(desc, coord, barrier, smem)`` in 3.9: the same arguments, the same op
  (3.9 keeps the old name as a stub that raises).
- The barrier of the threads running a function (in a warp_specialize partition, of its warps
  alone): ``gl.thread_barrier()`` in 3.6, ``gl.barrier()`` in 3.9: both a bar.sync of those
  threads (3.9's takes cluster=True for a cluster barrier, which the kernels do not ask for).

The rest of what the kernels call takes the same arguments in both: warp_specialize(
functions_and_args, worker_num_warps, worker_num_regs) (3.9 makes the registers optional),
mbarrier.init / expect / wait / arrive (3.9 adds keyword-only multi-CTA arguments),
warpgroup_mma / warpgroup_mma_wait, fence_async_shared, allocate_shared_memory, the layouts,
TensorDescriptor.from_tensor, and the num_warps and maxnreg launch options.
"""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# (builtins: a @gluon.jit function calls them by these global names)
async_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
