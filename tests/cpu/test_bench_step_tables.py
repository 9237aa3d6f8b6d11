"""benchmarks/bench_step.py's tables from a report: the step table (with the op calls' paths while
timed) and where each compiler's GPU time went."""

from benchmarks import bench_step


def _report():
    meta = {
        "model": "titan", "size": "llama3-8b", "layers": 4, "vocab": 128256, "batch": 1, "seq": 8192, "tp": 2, "dp": 1,
        "world": 2, "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
    }  # fmt: skip
    profile = {"span_us": 100.0, "busy_us": 90.0, "exposed_us": 6.0, "by_category": {"gemm": 50.0, "all_gather": 3.0}}
    compilers = {
        "inductor": {"step_us": 1000, "host_us": 700, "loss_vs_eager": 1e-4, "profile": profile,
                     "phases": {"forward gpu_us": 300, "forward host_us": 200}},
        "overlap": {"step_us": 980, "host_us": 690, "loss_vs_eager": 2e-4,
                    "op_calls_timed": {"replayed": 960, "captured": 32, "eager": 32},
                    "profile": {**profile, "span_us": 95.0, "exposed_us": 2.0, "by_category": {"gemm": 49.0, "overlap_fused": 4.0}},
                    "phases": {"forward gpu_us": 290, "forward host_us": 190}},
    }  # fmt: skip
    return {"meta": meta, "result": {"compilers": compilers}}


def test_the_step_table_says_how_overlaps_calls_ran():
    text = bench_step.table(_report())
    assert "| overlap | 980 | 1.02x | 690 | 2.0e-04 |" in text
    assert "960 replayed, 32 captured, 32 eager" in text


def test_where_the_gpu_time_went():
    lines = bench_step.profile_table(_report()).splitlines()
    assert lines[0] == "| GPU time (µs) | plain Inductor | overlap |"
    assert "| idle | 10 | 5 |" in lines
    assert "| exposed communication | 6 | 2 |" in lines
    # a category one compiler has and the other not reads 0 there
    assert "| all_gather | 3 | 0 |" in lines and "| overlap_fused | 0 | 4 |" in lines
    assert "| forward gpu (unprofiled) | 300 | 290 |" in lines
