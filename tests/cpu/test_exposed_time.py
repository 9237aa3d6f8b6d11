"""benchmarks/exposed_time.py's account of a GPU timeline, on synthetic chrome traces: what each
activity counts as, the part of a collective no computation covers, and the passes of each
profiled step told apart by their marks."""

import pytest

from benchmarks import exposed_time as et


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _mark(name, ts):
    return {"ph": "X", "cat": "user_annotation", "name": et.MARK + name, "ts": ts, "dur": 1}


@pytest.mark.parametrize(
    "event, kind",
    [
        (_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 1), "all_gather"),
        (_kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(...)", 0, 1), "reduce_scatter"),
        (_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)", 0, 1), "all_reduce"),
        (_kernel("ncclDevKernel_SendRecv(...)", 0, 1), "nccl"),
        (_kernel("Memcpy PtoP (Device -> Device)", 0, 1, "gpu_memcpy"), "p2p_copy"),
        (_kernel("Memcpy DtoD (Device -> Device)", 0, 1, "gpu_memcpy"), "compute"),
        (_kernel("barrier_kernel", 0, 1), "waiting"),
        (_kernel("wait_kernel", 0, 1), "waiting"),
        (_kernel("reduce_partials_kernel", 0, 1), "reduce_scatter"),
        (_kernel("one_shot_all_reduce_kernel", 0, 1), "all_reduce"),
        (_kernel("all_gather_matmul_tma_kernel", 0, 1), "compute"),
        (_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 1), "compute"),
        ({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}, ""),
    ],
)
def test_what_each_activity_counts_as(event, kind):
    assert et.kind_of(event) == kind


def test_the_exposed_part_of_a_collective_is_what_no_computation_covers():
    """An all-gather 0-100 beside GEMMs 20-50 and 40-70 (overlapping each other) and a wait
    70-100: 50 µs of it exposed (the wait hides nothing); a reduce-scatter 150-200 inside a GEMM
    120-220: hidden whole; a copy 300-310 alone: exposed."""
    events = [
        _kernel("ncclDevKernel_AllGather_RING", 0, 100),
        _kernel("gemm", 20, 30), _kernel("gemm", 40, 30), _kernel("wait_kernel", 70, 30),
        _kernel("gemm", 120, 100), _kernel("ncclDevKernel_ReduceScatter_Sum", 150, 50),
        _kernel("Memcpy PtoP (Device -> Device)", 300, 10, "gpu_memcpy"),
    ]  # fmt: skip
    found = et.account(events)
    assert found["span_us"] == 310
    assert found["communication_us"] == 160 and found["computation_us"] == 150
    assert found["exposed_us"] == 60
    assert found["by_kind"] == {"all_gather": 50, "reduce_scatter": 0, "p2p_copy": 10}
    assert found["collectives"] == [("all_gather", 100, 50), ("reduce_scatter", 50, 0), ("p2p_copy", 10, 10)]


def test_collectives_that_overlap_each_other_count_once_in_the_pass():
    events = [_kernel("ncclDevKernel_AllGather", 0, 10), _kernel("Memcpy PtoP", 5, 10, "gpu_memcpy")]
    found = et.account(events)
    assert found["communication_us"] == 15 and found["exposed_us"] == 15


def test_steps_and_passes_are_told_apart_by_their_marks():
    """Two steps; each pass takes the activities that start from its mark to the next one's."""
    trace = {
        "traceEvents": [
            _mark("forward", 0), _kernel("gemm", 1, 5), _kernel("ncclDevKernel_AllGather", 2, 3),
            _mark("backward", 10), _kernel("gemm", 11, 5), _kernel("ncclDevKernel_ReduceScatter", 20, 4),
            _mark("forward", 30), _kernel("gemm", 31, 2), _kernel("ncclDevKernel_AllGather", 33, 1),
            _mark("backward", 40), _kernel("gemm", 41, 1),
            _mark(et.BETWEEN, 50), _kernel("ncclDevKernel_AllReduce", 51, 1),  # a barrier: no pass's
        ]
    }  # fmt: skip
    steps = et.split_passes(trace)
    assert [[len(step[p]) for p in et.PASSES] for step in steps] == [[2, 2], [2, 1]]
    summary = et.summarize(steps)
    assert summary["forward"]["exposed_us"] == 0.5  # the median of 0 and 1
    assert summary["backward"]["exposed_us"] == 2.0  # (4 and 0)
    assert "| overlap | backward |" in et.table({"overlap": summary}, per_collective=True)


@pytest.mark.parametrize(
    "name, category",
    [
        ("all_gather_matmul_pingpong_kernel", "overlap_fused"),
        ("matmul_reduce_scatter_tma_kernel", "overlap_fused"),
        ("reduce_partials_kernel", "reduce_scatter"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor_fused"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
        ("wait_kernel", "waiting"),
        ("wait_for_peers_kernel", "waiting"),
        ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ],
)
def test_where_a_kernels_time_goes(name, category):
    assert et.category_of(_kernel(name, 0, 1)) == category


def test_a_whole_step_is_accounted_by_category():
    """One mark per step: busy time is the union of every activity, idle the rest of the span,
    and each category's time the sum of its kernels'."""
    trace = {
        "traceEvents": [
            _mark("step", 0), _kernel("nvjet_gemm", 0, 10), _kernel("nvjet_gemm", 5, 10), _kernel("triton_poi_x", 20, 5),
            _mark("step", 100), _kernel("nvjet_gemm", 100, 12), _kernel("ncclDevKernel_AllGather", 120, 5),
        ]
    }  # fmt: skip
    steps = et.split_passes(trace, ("step",))
    assert len(steps) == 2
    found = et.account(steps[0]["step"])
    assert found["span_us"] == 25 and found["busy_us"] == 20
    assert found["by_category"] == {"gemm": 20, "inductor_fused": 5}
    assert et.top_kernels(steps[0]["step"], 1) == [("nvjet_gemm", 20, 2)]
    summary = et.summarize(steps, ("step",))["step"]
    assert summary["by_category"]["all_gather"] == 2.5  # (0 and 5)
    assert summary["top_kernels"] == [("nvjet_gemm", 20, 2), ("triton_poi_x", 5, 1)]  # the first step's
    rows = et.category_table({"inductor": {"step": summary}}).splitlines()
    assert rows[0] == "| compiler | pass | all_gather | gemm | inductor_fused |"
    assert rows[2] == "| inductor | step | 2 | 16 | 2 |"  # medians of (0, 5), (20, 12), (5, 0)


def _range(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_the_host_side_of_each_pass():
    """A pass's host time is how long its mark was open; its busiest host ranges are those that
    start inside that window, summed by name, on any thread."""
    forward, backward = _mark("forward", 0), _mark("backward", 100)
    forward["dur"], backward["dur"] = 40, 70
    trace = {
        "traceEvents": [
            forward, _range("overlap::all_gather_matmul", 5, 10), _range("overlap::all_gather_matmul", 20, 12),
            _range("aten::mm", 30, 3), _range("aten::mm", 60, 100),  # after the forward's window: no pass's
            backward, _range("autograd::engine::evaluate_function", 101, 60),
            _mark(et.BETWEEN, 200), _range("c10d::barrier", 201, 5),
        ]
    }  # fmt: skip
    steps = et.host_passes(trace)
    assert steps[0]["forward"] == {"host_us": 40, "ops": [("overlap::all_gather_matmul", 22, 2), ("aten::mm", 3, 1)]}
    assert steps[0]["backward"]["ops"] == [("autograd::engine::evaluate_function", 60, 1)]
    summary = et.summarize_host(steps)
    assert summary["backward"]["host_us"] == 70
    assert "| overlap | forward | 40 | overlap::all_gather_matmul 22 (2); aten::mm 3 (1) |" in et.host_table({"overlap": summary})


def test_a_gpu_timeline_keeps_the_gpu_activities_and_the_marks():
    host_op = _range("aten::mm", 1, 2)
    trace = {"traceEvents": [_mark("forward", 0), host_op, _kernel("nvjet_gemm", 3, 4), {"ph": "M", "name": "process_name"}]}
    kept = et.gpu_timeline(trace)["traceEvents"]
    assert [e["name"] for e in kept] == [et.MARK + "forward", "nvjet_gemm"]
