"""``python -m tim_megatron.gpu_check [--cpu] [--json PATH] [--workdir DIR]`` (``make gpu-check``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tim_megatron.gpu_check", description=__doc__)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="without a GPU, run the sections that can run on CPU (a test of the code path, not GPU figures)",
    )
    ap.add_argument(
        "--json", type=Path, help="where to write the report (default runs/gpu-check/<time>.json)"
    )
    ap.add_argument(
        "--workdir", type=Path, help="checkpoints built for the check (default: a temporary folder)"
    )
    a = ap.parse_args(argv)

    import torch

    from tim_megatron.gpu_check.report import NO_GPU

    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu:
        print(NO_GPU)
        return 0
    from tim_megatron.gpu_check import run
    from tim_megatron.gpu_check.models import gpu_type_key
    from tim_megatron.gpu_check.report import row
    from tim_megatron.gpu_check.sections import Bench

    gpu_type = None
    if cuda:
        p = torch.cuda.get_device_properties(0)
        gpu_type = gpu_type_key(p.name, p.total_memory)

    def echo(f):
        print(row(f), flush=True)

    with tempfile.TemporaryDirectory(prefix="tim-gpu-check-") as tmp:
        bench = Bench(device="cuda" if cuda else "cpu", workdir=a.workdir or Path(tmp), gpu_type=gpu_type)
        report = run(bench, echo=echo)
    print(report.text())
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = report.save(a.json or Path("runs") / "gpu-check" / f"{stamp}.json")
    print(f"report: {path}")
    return report.exit_code


if __name__ == "__main__":  # the guard matters: megatron's checkpoint writers start processes
    sys.exit(main())
