"""One line of an A/B run (scripts/ab_bench.sh, scripts/ab_env.sh): the headline numbers of a
`mrv2 bench latency|throughput --json` result.

Usage: python3 scripts/ab_summary.py RESULT.json SIDE ROUND
"""

import json
import sys

path, side, round_ = sys.argv[1:4]
with open(path) as f:
    rows = json.load(f)["default"]
if isinstance(rows, dict):  # throughput
    print(side, round_, f"tok/s {rows['output_tok_s']}  s {rows['seconds']}  "
          f"floor {rows['floor_fraction']}  host/step {rows['cpu_execute_ms_per_step']} ms")
else:
    print(side, round_, "  ".join(
        f"b{r['batch']}: tpot {r['tpot_ms']} gpu {r.get('gpu_step_ms')} "
        f"host {r.get('host_execute_ms')}" for r in rows))
