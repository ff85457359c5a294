"""Run by tests/test_plan.py (in tests/support/forked_runs.py's child, which has imported torch): plan.py's bytes a
step and peak memory of each layout's traced ranks, as the planner counts them for gloo. Prints one JSON line,
{"<layout> <rank>": [bytes, peak bytes]}.

    python tests/support/plan_traffic.py '[["TP 2", "--tp 2", 2, [0]]]' '--dim 32 --n_layers 4 ...'
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import plan

layouts, model = json.loads(sys.argv[1]), sys.argv[2]
found = {}
for name, flags, world_size, ranks in layouts:
    for rank in ranks:
        args = plan.parse_args([*flags.split(), *model.split(), "--world_size", str(world_size), "--rank", str(rank),
                                "--backend", "gloo"])
        result = plan.trace(args)
        found[f"{name} {rank}"] = (sum(row[-1] for row in plan.traffic(result, "gloo")), result["peak"]["Total"])
print(json.dumps(found))
