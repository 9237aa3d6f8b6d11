"""Usage: PYTHONPATH=$PWD:$PWD/docs/bench/2026-11-24-s15/hf_sweep python3 docs/bench/2026-11-24-s15/hf_sweep/run_one.py MODEL [overlap|inductor]"""
import collections, json, sys, tempfile, time, traceback

if __name__ == "__main__":
    sys.path.insert(0, "/work/main/tests")
    from rank_pool import RankPool
    import sweep_cases
    name = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "overlap"
    pool = RankPool(2, "gloo")
    t = time.time()
    status = "PASS"
    try:
        folder = tempfile.mkdtemp(prefix=f"ckpt-{name}-", dir=tempfile.gettempdir())
        res = pool.run(sweep_cases.forward_backward, name, folder, 2, 12, backend)
        pool.close()
        for r, out in enumerate(res):
            if out["mismatches"]:
                status = "FAIL(mismatch)"
                print(f"rank {r} mismatches:")
                for m in out["mismatches"]:
                    print("   ", m)
        dec = res[0]["decisions"]
        counts = collections.Counter((d["graph"], d["kind"], d["rewritten"]) for d in dec)
        print("decisions rank0:", json.dumps({str(k): v for k, v in sorted(counts.items())}))
        reasons = collections.Counter((d["graph"], d["kind"], d["reason"]) for d in dec if not d["rewritten"])
        for k, v in sorted(reasons.items()):
            print("  not rewritten:", k, "x", v)
        same = res[0]["decisions"] == res[1]["decisions"]
        print("ranks' decisions identical:", same, "dump:", res[0]["dump"])
    except Exception as e:
        status = "FAIL(exception)"
        print(str(e))
        pool.close(force=True)
    print(f"RESULT {name} {backend} {status} {time.time()-t:.0f}s")
