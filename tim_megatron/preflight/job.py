"""What every rank of a preflight job runs (``tim preflight-job --run-dir RUN_DIR``), phase by phase.

0. model: the checkpoint in place on every rank (``model.path`` downloaded, or the tiny model built), as the
   run's start-up does before torch.distributed exists (transformers saves only on rank 0 once it does);
1. rendezvous: torch.distributed and megatron-core's TP/EP/DP groups, exactly as the trainer builds them;
2. doctor: ``tim doctor``'s checks on the first rank of each node, with the job's recipe;
3. devices: each rank's node, host and device (the judge finds sharing and count mismatches);
4. bandwidth: all-reduce bus bandwidth within nodes, across nodes and in the TP, EP and DP groups;
5. setup and steps: ``run_setup.setup`` (trainer, rollout engines, data) and two steps of ``loop.run_steps``,
   watched through the loop's hook by :class:`tim_megatron.preflight.steps.Records`;
   align, only after a failed sync check: ``tim align``'s comparison of each rank's engine with the trainer, on
   the probe sequences, written to ``RUN/align/`` by the failing engine's first rank;
6. report: rank 0 assembles ``preflight.json``, judges it and prints the summary.

Each phase writes this rank's heartbeat before and after it; a watchdog ends a phase that runs past its timeout.
A phase's results are gathered on every rank and written by rank 0 to ``preflight/results/<phase>.json``. A
failed phase, a doctor fail or a device problem stops the job before its loop; low bandwidth does not (the rest
is still measured). Every rank exits 0 on go and 1 on no-go.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from tim_megatron.modes import modes_of
from tim_megatron.preflight import report as rep
from tim_megatron.preflight.devices import infiniband_ports, node_of, probe
from tim_megatron.preflight.heartbeat import Heartbeat, Watchdog
from tim_megatron.preflight.judge import blocking

WATCHDOG_GRACE_S = 20.0
"""A rank other than 0 whose phase timed out waits this long before it ends, so rank 0 can write the verdict."""


def nccl_debug_to_files(run_dir: Path) -> dict | None:
    """NCCL's INIT/NET log into ``preflight/nccl/<host>.<pid>.log`` (before any communicator): it names the
    network NCCL chose. Only on CUDA, and only when the job's environment does not route NCCL's log itself."""
    import torch

    if not torch.cuda.is_available() or "NCCL_DEBUG_FILE" in os.environ:
        return None
    d = rep.folder(run_dir) / "nccl"
    d.mkdir(parents=True, exist_ok=True)
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(d / "%h.%p.log")}
    os.environ.update(env)
    return env


class Job:
    """One rank of the preflight job: its heartbeat, its place, and what the phases hand each other."""

    def __init__(self, run_dir: Path, *, console=None):
        from tim_megatron.run_dir import load_run

        self.run_dir = Path(run_dir).resolve()
        self.request = rep.read_request(self.run_dir)
        self.loaded = load_run(self.run_dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.node, self.host = node_of()
        self.console = console
        self.hb = Heartbeat(self.run_dir, rank=self.rank, host=self.host, timeouts=self.request["timeouts"])
        self.parts = None
        self.memory = None
        self.ranks_info: list[dict] = []

    # ------------------------------------------------------------------------------------ machinery

    def gather(self, local: dict) -> list[dict]:
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [local]
        box: list = [None] * dist.get_world_size()
        dist.all_gather_object(box, local)
        return box

    def phase(self, name: str, fn) -> list[dict]:
        """Run ``fn`` (returns this rank's results; an ``error`` key marks a failure) between heartbeats, gather
        every rank's results, and have rank 0 write them."""
        self.hb.begin(name)
        try:
            local = {"rank": self.rank, **fn()}
        except Exception as e:
            local = {"rank": self.rank, "error": f"{type(e).__name__}: {e}"}
        if "error" in local:  # recorded before the gather, which may wait for ranks that hang
            self.hb.end(name, error=local["error"])
        gathered = self.gather(local)
        if "error" not in local:
            self.hb.end(name)
        if self.rank == 0:
            rep.write_results(self.run_dir, name, gathered)
        return gathered

    def stop_here(self) -> bool:
        """Rank 0 decides from the phases so far whether the loop can still run; every rank learns it."""
        from tim_megatron.rl.batch import broadcast_object

        stop = bool(blocking(rep.assemble(self.run_dir))) if self.rank == 0 else False
        return bool(broadcast_object(stop))

    def on_timeout(self, phase: str) -> None:
        """The watchdog's handler: rank 0 writes the verdict; every rank then ends (torchrun ends the rest)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):
                report = rep.finalize(
                    self.run_dir,
                    job=self._job(ended=False, note=f"phase {phase} timed out"),
                    written_by="job (watchdog)",
                )
                print(rep.summary(report), flush=True)
        else:
            time.sleep(WATCHDOG_GRACE_S)
        os._exit(124)

    def _job(self, *, ended: bool, note: str | None = None) -> dict:
        out = {"id": os.environ.get("SLURM_JOB_ID"), "state": "RUNNING", "ended": ended}
        if note:
            out["note"] = note
        return out

    # ---------------------------------------------------------------------------------------- phases

    def model(self) -> dict:
        from tim_megatron.run_setup import model_path_for

        return {"path": str(model_path_for(self.loaded.recipe))}

    def rendezvous(self) -> dict:
        from patches.megatron import cpu_shims
        from tim_megatron.trainer.parallel import init_parallel

        r = self.loaded.recipe
        handle = cpu_shims.apply() if cpu_shims.needed() else None  # megatron's RNG seeding needs them on CPU
        try:
            env = init_parallel(r.parallel, seed=r.run.seed, timeout_minutes=r.parallel.timeout_minutes)
        finally:
            if handle is not None:
                handle.revert()  # the trainer applies its own
        return {"world": env.world_size, "launcher": env.launcher}

    def doctor(self) -> dict:
        if self.local_rank != 0:
            return {}
        from tim_megatron.doctor import CHECKS, Context, run_checks
        from tim_megatron.doctor.base import as_record

        ctx = Context(
            environ=dict(os.environ),
            recipe=self.loaded,
            recipe_arg=str(self.run_dir / "recipe.yaml"),
        )
        results = [as_record(r) for r in run_checks(ctx, CHECKS)]
        return {"node": self.node, "host": self.host, "results": results}

    def devices(self) -> dict:
        out = probe(self.rank, self.local_rank)
        if self.local_rank == 0:
            out["infiniband"] = infiniband_ports()
        return out

    def bandwidth(self) -> dict:
        import torch

        from tim_megatron.preflight.bandwidth import measure, nccl_networks

        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        records = measure(self.ranks_info, rank=self.rank, device=device, on_gpu=cuda)
        networks = []
        if cuda:
            host = socket.gethostname().split(".")[0]
            networks = nccl_networks(rep.folder(self.run_dir) / "nccl", host=host, pid=os.getpid())
            torch.cuda.empty_cache()  # the buffers must not count in the loop's peak
        return {"records": records, "networks": networks}

    def setup(self) -> dict:
        from tim_megatron.preflight.steps import PeakMemory, classify_setup_error
        from tim_megatron.run_setup import setup

        self.memory = PeakMemory()
        self.memory.start()
        try:
            self.parts = setup(self.loaded, self.run_dir, resume=False, console=self.console)
        except Exception as e:
            self._mark_failed(e)
            return classify_setup_error(e)
        return {"engine": self.parts.rollout.describe()}

    def steps(self) -> dict:
        from tim_megatron.loop import run_steps
        from tim_megatron.preflight.steps import Records

        records = Records()
        t0 = time.perf_counter()
        out: dict = {}
        try:
            # marks run.json itself (completed, or failed with the reason)
            run_steps(self.parts, loaded=self.loaded, run_dir=self.run_dir, observer=records)
        except Exception as e:
            from tim_megatron.rollout.sync import WeightSyncError

            out["error"] = f"{type(e).__name__}: {e}"
            if isinstance(e, WeightSyncError):
                out["sync_failed_engines"] = e.engines
        wall = time.perf_counter() - t0
        out.update(records=records.as_dict(), memory=self.memory.result())
        if self.rank == 0 and "error" not in out:
            out["checkpoint"] = self._checkpoint(wall)
        return out

    def align(self, failed: list[int]) -> dict:
        """After a failed sync check: ``tim align``'s comparison of this rank's engine (as the failed sync left it)
        with the trainer, on the probe sequences, in this job's processes. The first rank of a failing engine
        writes ``RUN/align/`` (``tim report`` shows it); rank 0 reads it into the verdict."""
        from tim_megatron.align.report import where as where_of
        from tim_megatron.align.report import write
        from tim_megatron.align.run import AlignOptions, compare_sides, refuse, tolerance_for

        r, engine, trainer = self.loaded.recipe, self.parts.rollout, self.parts.trainer
        try:
            refuse(r)
        except ValueError as e:
            return {"skipped": str(e)}
        options = AlignOptions(tolerance=tolerance_for(r))
        result = compare_sides(
            engine, trainer, self.parts.probe, options, replay=modes_of(r).routing.engine_routes
        )
        where = engine.describe()
        writer = where["engine"] == min(failed) and where["rank"] == where["ranks"][0]
        if writer:
            meta = {"recipe": self.loaded.name, "engine": where["engine"], "written_by": "tim preflight"}
            write(result, self.run_dir / "align", sequences=len(self.parts.probe), meta=meta)
        return {
            "engine": where["engine"],
            "writer": writer,
            "where": where_of(result),
            "tolerance": options.tolerance,
            "tokens_differing_any_layer": result.tokens_differing_any_layer,
            "alignment": result.as_dict(),
        }

    def _checkpoint(self, wall: float) -> dict:
        """The loop's final checkpoint: its size, and the time the run spent after its last step (the save and
        the end-of-run summary); then deleted (a shrunk run's weights are of no use)."""
        from tim_megatron.logging.tracker import read_metrics

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        stepped = sum(r.get("time/step", 0.0) for r in rows)
        folder = self.run_dir / "checkpoints"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
        return {"bytes": size, "seconds": max(0.0, wall - stepped)}

    def _mark_failed(self, e: BaseException) -> None:
        from tim_megatron.run_dir import mark_failed

        if self.rank == 0:
            with contextlib.suppress(OSError):
                mark_failed(self.run_dir, e)

    # ------------------------------------------------------------------------------------------ order

    def main(self) -> int:
        def ok(gathered: list[dict]) -> bool:
            return not any("error" in d for d in gathered)

        up = self.phase("model", self.model)
        if ok(up):
            up = self.phase("rendezvous", self.rendezvous)
        if ok(up):
            self.phase("doctor", self.doctor)
            gathered = self.phase("devices", self.devices)
            self.ranks_info = [{k: v for k, v in d.items() if k != "infiniband"} for d in gathered]
            if (
                not self.stop_here()
                and ok(self.phase("bandwidth", self.bandwidth))
                and ok(self.phase("setup", self.setup))
            ):
                stepped = self.phase("steps", self.steps)
                failed = sorted({e for d in stepped for e in d.get("sync_failed_engines", [])})
                if failed:  # every rank has the same gathered results, so every rank takes this branch
                    self.phase("align", lambda: self.align(failed))
        return self.report(rendezvous_ok=ok(up))

    def report(self, *, rendezvous_ok: bool) -> int:
        go = False
        if self.rank == 0:
            shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)
            report = rep.finalize(self.run_dir, job=self._job(ended=False), written_by="job")
            print(rep.summary(report), flush=True)
            go = report["verdict"]["go"]
        if rendezvous_ok:
            from tim_megatron.rl.batch import broadcast_object

            go = bool(broadcast_object(go))
        return 0 if go else 1


def run(run_dir: Path, *, console=None) -> int:
    """The job's entry point on every rank; returns the exit code (0 go, 1 no-go)."""
    from tim_megatron.run_lock import hold

    if "RANK" in os.environ:  # a rank of torchrun: it dies with its launcher
        from tim_megatron.procs import die_with_parent

        die_with_parent()
    job = Job(run_dir, console=console)
    lock = hold(job.run_dir) if job.rank == 0 else None  # released at exit
    env = nccl_debug_to_files(job.run_dir)
    if env and job.rank == 0:
        with contextlib.suppress(OSError):
            (rep.folder(job.run_dir) / "nccl" / "settings.json").write_text(json.dumps(env))
    watchdog = Watchdog(job.hb, job.on_timeout)
    watchdog.start()
    try:
        return job.main()
    finally:
        watchdog.stop()
        del lock
