"""One line of an A/B run (scripts/ab_bench.sh, scripts/ab_env.sh): the headline numbers of a
`mrv2 bench latency|throughput --json` result.

Usage: python3 scripts/ab_summary.py RESULT.json SIDE ROUND
"""

import json
import sys

path, side, round_ = sys.argv[1:4]
with open(path) as f:
    result = json.load(f)
rows = result["default"]
if isinstance(rows, dict):  # throughput
    print(side, round_, f"tok/s {rows['output_tok_s']}  s {rows['seconds']}  "
          f"floor {rows['floor_fraction']}  host/step {rows['cpu_execute_ms_per_step']} ms")
else:  # latency: the default, then each variant (--variants) on its own line
    for name, value in result.items():
        if not isinstance(value, list):
            continue
        print(side, round_, name, "  ".join(
            f"b{r['batch']}: ttft {r.get('ttft_ms')} tpot {r['tpot_ms']} "
            f"gpu {r.get('gpu_step_ms')} "
            f"host {r.get('host_execute_ms')}" for r in value if "batch" in r)
            + f"  kv_blocks {result.get('kv_blocks', {}).get(name)}")
