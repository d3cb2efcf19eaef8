"""``tim preflight``'s side: submit the job through ``tim submit``'s own path, follow its phases, report.

The job is rendered from the same template as a real run (``launch/tim.sbatch``: its rendezvous, environment
and container), into a run folder of its own, with ``tim preflight-job`` as the ranks' command. While it runs, the
ranks' heartbeats are followed and each phase's start and end printed. When the job ends, ``preflight.json`` is
assembled again from the run folder with the job's final Slurm state, so a job that died without writing its
verdict (a hang past a timeout, a crash, the time limit) still gets one, naming the phase.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tim_megatron.preflight import report as rep
from tim_megatron.preflight.heartbeat import phase_states, read_heartbeats, write_json
from tim_megatron.preflight.shrink import Preflight

JOB_COMMAND = "preflight-job"
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)
UNKNOWN_LIMIT_S = 60.0
"""A job Slurm no longer knows for this long counts as ended."""


def submit(pf: Preflight, *, output_dir: str | Path | None = None):
    """Create the run folder (recipe, job script, ``preflight/request.json``) and sbatch the job."""
    from tim_megatron.slurm.submit import prepare, submit_prepared

    run_dir, _ = prepare(pf.shrunk, output_dir=output_dir, command=JOB_COMMAND)
    write_json(rep.folder(run_dir) / "request.json", pf.request(), root=Path(run_dir))
    return submit_prepared(run_dir)


def dry_run(pf: Preflight) -> str:
    """The overrides and the job script ``submit`` would use, for a run folder that is not created."""
    from tim_megatron.slurm.render import render

    root = Path(pf.shrunk.recipe.run.output_dir).resolve()
    script = render(
        pf.shrunk.recipe,
        run_dir=root / pf.shrunk.name / "DRY-RUN",
        job_name=pf.shrunk.name,
        command=JOB_COMMAND,
    )
    lines = [f"# preflight of {pf.full.name}: the recipe's layout, its workload shrunk by"]
    lines += [f"#   {s.key}={json.dumps(s.value)}  ({s.why})" for s in pf.shrink]
    lines += [f"#   {k}: kept as given on the command line" for k in pf.kept]
    return "\n".join(lines) + "\n" + script


def watch(
    run_dir: Path,
    job: str,
    *,
    say: Callable[[str], None] = print,
    poll_s: float = 2.0,
    state_of: Callable[[str], str | None] | None = None,
) -> dict:
    """Follow the job until it ends, printing phase changes; then write and return ``preflight.json``."""
    from tim_megatron.slurm.submit import job_state

    state_of = state_of or job_state
    t0 = time.time()
    shown: dict[str, str] = {}
    state, unknown_since = None, None
    while True:
        for name, p in phase_states(read_heartbeats(run_dir)).items():
            label = p["state"]
            if shown.get(name) != label:
                shown[name] = label
                ranks = sum(len(v) for v in p["ranks"].values())
                took = f" in {p['seconds']:.1f} s" if label != "running" else ""
                say(f"  [{time.time() - t0:6.0f} s] {name}: {label} ({ranks} rank(s)){took}")
        state = state_of(job)
        if state in ENDED:
            break
        if state is None:
            unknown_since = unknown_since or time.time()
            if time.time() - unknown_since > UNKNOWN_LIMIT_S:
                state = "UNKNOWN"
                break
        else:
            unknown_since = None
        time.sleep(poll_s)
    return rep.finalize(run_dir, job={"id": job, "state": state, "ended": True}, written_by="tim preflight")
