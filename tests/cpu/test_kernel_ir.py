"""The fused TMA kernels compiled for Hopper on the CPU (tests/kernel_ir.py): every variant the
ops launch keeps what its speed rests on, which no CPU test of results can see and a GPU shows
only as time. Each of these regressed silently once (on an H100: 5 to 70% slower):
- the tile loop flattened into the K loop (an atomic under a branch of the body broke it);
- the loads software-pipelined (a poll loop or a tl.debug_barrier in the body stopped it);
- 16-byte stores (an alignment hint on an integer address was lost: 2-byte stores);
- shared memory within Hopper's limit (fp32 outputs flattened did not fit).
Exact float8 accumulation keeps its tile loop apart on purpose (gemm.flatten_tiles). The
compiles run in a process of their own: the other CPU tests set TRITON_INTERPRET=1."""

import json
import os
import subprocess
import sys

import pytest
import triton.backends

from tests import kernel_ir

pytestmark = pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="triton without its CUDA backend")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernel_ir", "--json"], env=env, capture_output=True, text=True, timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["what"]: row for row in json.loads(done.stdout.splitlines()[-1])}


@pytest.mark.parametrize("what", [w for w, _ in kernel_ir.variants()])
def test_kernel_keeps_its_pipeline(compiled, what):
    ir = compiled[what]
    assert ir["pipelined"], f"{what}: TMA loads not issued ahead of the dot ({ir['tma_loads']} in the TTGIR)"
    assert ir["flattened"] == ("exact" not in what), f"{what}: tile loop flattened {ir['flattened']}"
    assert set(ir["stores"]) == {"st.global.v4.b32"}, f"{what}: stores {ir['stores']}"
    assert ir["shared_bytes"] <= kernel_ir.SMEM_LIMIT, f"{what}: {ir['shared_bytes']} bytes of shared memory"


def _gluon_rows(flag: str) -> list[dict]:
    """tests.kernel_ir's JSON for the Gluon kernels, from a process of its own (not under
    TRITON_INTERPRET=1, which makes kernels uncompilable)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernel_ir", flag], env=env, capture_output=True, text=True,
        timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_gluon_pingpong_consumer_compiles_with_its_waits_and_partitions():
    """The Gluon float8 consumer, each config, tensorwise and rowwise, over three weights in
    one launch (Q, K, V), and in its exact-accumulation form: warp groups resized
    (setmaxnreg: the loader's few registers, the consumers' many), wgmma, the loader's flag poll
    as system-scope acquire loads (twice: before and inside the bounded loop) and the fence
    that lets TMA see what they made visible, within Hopper's shared memory."""
    rows = _gluon_rows("--pingpong")
    assert [ir["what"].split(" B=")[1] for ir in rows] == ["1"] * 4 + ["3"] + ["2"] * 2, rows
    assert [" exact " in ir["what"] for ir in rows] == [False] * 5 + [True] * 2, rows
    for ir in rows:
        assert ir["wgmma"] > 0 and ir["flag_polls"] == 2 and ir["async_fences"] == 1, ir
        assert set(ir["stores"]) == {"st.global.v4.b32"}, ir  # 16 bytes, not the wgmma layout's 4
        assert ir["setmaxnreg"][0] <= 40 and ir["setmaxnreg"][-1] >= 232, ir
        assert ir["shared_bytes"] <= kernel_ir.SMEM_LIMIT, ir


def test_gluon_pingpong_producer_compiles_with_its_publishing():
    """The Gluon float8 producer, each config, tensorwise and rowwise, then its cooperative form
    (exact accumulation; a sum of three matmuls, Q, K and V's input gradient): warp groups
    resized, wgmma, each warpgroup's publishing (a counter add, acq_rel at system scope, and a
    flag write, release at system scope: one of each per warpgroup) behind barriers of 128
    threads only (a CTA-wide bar.sync in a partition would wait for the other partitions
    forever)."""
    rows = _gluon_rows("--pingpong-producer")
    assert [ir["what"].split("terms=")[1] for ir in rows] == ["1"] * 5 + ["3"], rows
    assert [" exact " in ir["what"] for ir in rows] == [False] * 4 + [True] * 2, rows
    # the cooperative form: half a tile's wgmma per warpgroup, one per K block; three terms, three loops
    assert rows[5]["wgmma"] == 3 * rows[4]["wgmma"], rows
    for ir in rows:
        assert ir["wgmma"] > 0 and ir["counter_adds"] == 2 and ir["flag_writes"] == 2, ir
        assert set(ir["stores"]) == {"st.global.v4.b32"}, ir
        assert ir["barriers"] and all(b.replace(" ", "").replace("\t", "").endswith(",128;") for b in ir["barriers"]), ir
        assert ir["setmaxnreg"][0] <= 40 and ir["setmaxnreg"][-1] >= 232, ir
        assert ir["shared_bytes"] <= kernel_ir.SMEM_LIMIT, ir
