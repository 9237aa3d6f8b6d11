import json, sys
from tests.rank_pool import RankPool
import sweep_cases

if __name__ == "__main__":
    name = sys.argv[1]; backend = sys.argv[2] if len(sys.argv) > 2 else "overlap"
    spmd = sys.argv[3] if len(sys.argv) > 3 else "spmd_types"
    pool = RankPool(2, "gloo")
    try:
        res = pool.run(sweep_cases.forward_backward, name, backend, 2, 0, spmd)
    finally:
        pool.close()
    for r, o in enumerate(res):
        print(f"==== rank {r}: {o['status']}")
        print(json.dumps({k: v for k, v in o.items() if k != "traceback"}, indent=1, default=str))
        if "traceback" in o:
            print(o["traceback"])
