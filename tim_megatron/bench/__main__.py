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
    "step": "tim_megatron.bench.step",
}


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("-")] or list(BENCHES)
    rest = [a for a in argv if a.startswith("-")]
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
