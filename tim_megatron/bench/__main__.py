"""``python -m tim_megatron.bench [name ...]``: run benchmarks (all when none is named).

Each prints its numbers as ratios against the raw library measured in the same run, and runs in its own
process (megatron-core and vLLM keep process-wide state).
"""

from __future__ import annotations

import subprocess
import sys

BENCHES = {
    "metrics": "tim_megatron.bench.metrics",
    "trainer": "tim_megatron.bench.trainer",
    "rollout": "tim_megatron.bench.rollout",
    "process_sync": "tim_megatron.bench.process_sync",
    "step": "tim_megatron.bench.step",
    "fleet": "tim_megatron.bench.fleet",
    "exact": "tim_megatron.bench.exact",
    "experts": "tim_megatron.bench.experts",
    "dispatch": "tim_megatron.bench.dispatch",
    "step_paths": "tim_megatron.bench.step_paths",
    "offpolicy": "tim_megatron.bench.offpolicy",
    "sink_attention": "tim_megatron.bench.sink_attention",
}


def main(argv: list[str]) -> int:
    lead = []  # benchmark names come first; everything after them goes to each benchmark
    for a in argv:
        if a.startswith("-") or "=" in a or (lead and a not in BENCHES) or (not lead and a.isdigit()):
            break
        lead.append(a)
    names = lead or list(BENCHES)
    rest = argv[len(lead) :]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    rc = 0
    for n in names:
        rc |= subprocess.call([sys.executable, "-m", BENCHES[n], *rest])
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
