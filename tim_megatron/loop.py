"""The RL loop: rollout, rewards, advantages, old logprobs, mismatch metrics, update, weight sync, log.

:func:`train` starts a run (:mod:`tim_megatron.run_setup`) and :func:`run_steps` steps it; :func:`one_step` reads
one step top to bottom; the phases are in ``tim_megatron.rl.phases``.
The same loop runs ``make demo`` on a laptop CPU and the 30B Slurm jobs.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tim_megatron.observer import NO_OBSERVER, StepObserver
from tim_megatron.recipe import LoadedRecipe, Recipe
from tim_megatron.rl import phases, plumbing
from tim_megatron.rl.batch import broadcast_object, cat_padded
from tim_megatron.rl.colocation import Colocation
from tim_megatron.rl.overlap import start_ahead
from tim_megatron.rl.partial import partial_samples
from tim_megatron.rollout.faults import EngineLost
from tim_megatron.run_dir import RunDirNotWritable, record_step
from tim_megatron.safe_files import write_atomic
from tim_megatron.stop import EXIT_PREEMPTED, StopRequest
from tim_megatron.untrusted import recorded

if TYPE_CHECKING:
    from tim_megatron.run_setup import Prepared


def train(
    loaded: LoadedRecipe,
    run_dir: Path,
    *,
    resume: bool = False,
    console=None,
    trust_unverified: bool = False,
    stop: StopRequest | None = None,
    close: bool = True,
) -> int:
    """Run (or resume) the recipe in ``run_dir``; returns the process exit code.

    ``trust_unverified`` loads a checkpoint written before checksums were recorded (refused otherwise).
    ``stop``: the caller's installed stop request (see :mod:`tim_megatron.stop`).
    ``close``: release the engine and the trainer after a run that returned, so another run can start in this
    process. ``tim train`` passes False: its process exits at once, which releases everything sooner.
    """
    from tim_megatron.logging.library_log import routed
    from tim_megatron.run_setup import setup

    # the libraries' own output (start-up included) goes to logs/engine.log, the console keeps the step lines
    with routed(run_dir, level=loaded.recipe.logging.engine_level, console=console):
        parts = setup(
            loaded, run_dir, resume=resume, console=console, trust_unverified=trust_unverified, stop=stop
        )
        code = run_steps(parts, loaded=loaded, run_dir=run_dir)
        if close:
            parts.close()
        return code


def run_steps(
    parts: Prepared, *, loaded: LoadedRecipe, run_dir: Path, observer: StepObserver = NO_OBSERVER
) -> int:
    """The steps of a prepared run, from its start step; each logged, recorded, checkpointed when due.
    ``observer`` is told what the metrics do not keep apart (``tim preflight`` watches through it)."""
    r, state, trainer = loaded.recipe, parts.state, parts.trainer
    folder = RunFolder(run_dir=run_dir, loaded=loaded, is_rank0=trainer.is_rank0)
    parts.stop.steps_begin()  # from here a SIGTERM ends the step and checkpoints
    t_start = time.perf_counter()
    step = state.start_step - 1
    before = None
    try:
        for step in range(state.start_step, r.run.steps + 1):
            before = (
                state.checkpoint_view()
            )  # what an abort in this step checkpoints (the batches it takes too)
            metrics, events = one_step(parts, recipe=r, run_dir=run_dir, step=step, observer=observer)
            if step == state.start_step:
                metrics.update(parts.first_step_info)
            log_step(
                parts.tracker, recipe=r, step=step, metrics=metrics, events=events, is_rank0=trainer.is_rank0
            )
            # rank 0: a folder that refuses writes stops the run now
            unwritable = folder.record_progress(step)
            stop, write_error = broadcast_object((parts.stop.requested, unwritable and str(unwritable)))
            if write_error:
                raise unwritable or RunDirNotWritable(f"rank 0 could not write in {run_dir}: {write_error}")
            if stop or should_checkpoint(r, step):  # one write when both fall on the same step
                save(parts, run_dir=run_dir, recipe=r, step=step)
            if stop:
                folder.finish(parts, step, time.perf_counter() - t_start, status="preempted")
                return EXIT_PREEMPTED
    except BaseException as e:
        from tim_megatron.run_dir import mark_failed
        from tim_megatron.trainer.megatron_trainer import NonFiniteAbort

        if isinstance(e, NonFiniteAbort) or (isinstance(e, EngineLost) and e.before_update):
            # its updates were skipped, or the step had not updated yet: the weights are the last good ones, and
            # the loop's state is as the step found it (the batch it took to train is still waiting in it)
            kept = save(parts, run_dir=run_dir, recipe=r, step=step - 1, overwrite=False, view=before)
            e.args = (f"{e}; last good state checkpointed: {kept}",)
        if trainer.is_rank0:
            with contextlib.suppress(OSError):  # an unwritable run.json: the caller's attempt() says so
                mark_failed(run_dir, e, step=step)
        parts.tracker.close()
        raise
    if r.run.steps >= state.start_step and r.checkpoint.at_end:
        save(parts, run_dir=run_dir, recipe=r, step=r.run.steps)
    folder.finish(parts, r.run.steps, time.perf_counter() - t_start, status="completed")
    return 0


def one_step(
    parts: Prepared, *, recipe: Recipe, run_dir: Path, step: int, observer: StepObserver = NO_OBSERVER
) -> tuple[dict, list[dict]]:
    """One RL step, every rank: prompts -> samples -> rewards -> old logprobs -> advantages -> loss inputs ->
    update -> sync -> validation and dumps. Returns the step's metrics and early-warning events."""
    r, tr, ro, prompts = recipe, parts.trainer, parts.rollout, parts.prompts
    memory: Colocation = parts.colocation
    t = plumbing.Timer()
    cpu = plumbing.process_tree_cpu_seconds()
    ro.begin_step(step)
    with t("step"), contextlib.ExitStack() as cleanup:
        start, ahead = {}, None
        if step == 1 and r.run.val_every and r.run.val_samples:
            with t("validation"):  # the untrained policy: the lab's manipulation check (equal in every arm)
                start = phases.validate(recipe=r, rollout=ro, prompts=prompts, step=0, observer=observer)
        if parts.state.pending is None:
            with t("rollout"):  # each engine samples its block of the prompts and scores its samples
                batch, metrics, probe = phases.rollouts(
                    recipe=r, trainer=tr, rollout=ro, prompts=prompts, step=step, observer=observer
                )
                metrics.update(memory.to_trainer())
            # the trainer at the sampling weights; checks the last sync on these samples
            with t("old_logprobs"):
                old = phases.old_logprobs(
                    recipe=r,
                    trainer=tr,
                    rollout=ro,
                    sync=parts.sync,
                    batch=batch,
                    step=step,
                    observer=observer,
                )
                metrics.update(old.sync)
        else:  # off-policy: sample ahead, train the batch sampled rollout.max_staleness steps ago
            samples = partial_samples if r.rollout.partial.enabled else offpolicy_samples
            batch, metrics, probe, old, ahead = samples(
                parts, recipe=r, step=step, timer=t, observer=observer
            )
            if ahead is not None:
                cleanup.callback(ahead.wait)  # a failing step still lets the engine end its generation
        metrics.update({f"{k}_start": v for k, v in start.items()})
        with t("advantages"):
            adv = phases.advantages(recipe=r, batch=batch)
        with t("metrics"):
            weights, correction = phases.loss_weights(recipe=r, batch=batch, old=old, step=step)
            metrics.update(
                phases.step_metrics(recipe=r, batch=batch, old=old, adv=adv, correction=correction)
            )
        parts.state.schedule.observe(step, metrics)
        lr = parts.state.schedule.lr(step)
        with t("update"):
            metrics.update(
                phases.update(
                    recipe=r,
                    trainer=tr,
                    batch=batch,
                    old=old,
                    adv=adv,
                    weights=weights,
                    lr=lr,
                    step=step,
                    observer=observer,
                )
            )
        if ahead is not None:
            with t("ahead"):  # the batches sampled beside the update, scored at their sampling weights
                metrics.update(ahead.finish(parts, recipe=r, pending=parts.state.pending, observer=observer))
        with t("sync"):  # the new weights into every engine, verified
            metrics.update(
                memory.to_rollout(probe=probe or parts.probe, last=step == r.run.steps, observer=observer)
            )
        if ro.restartable:  # every rank's engine restarts, summed; the run's count goes on across attempts
            faults = phases.fault_metrics(ro)
            faults["faults/restarts_run"] = parts.state.count_restarts(faults["faults/restarts_run"])
            metrics.update(faults)
        if r.run.val_every and (step % r.run.val_every == 0 or step == r.run.steps):
            with t("validation"):
                metrics.update(
                    phases.validate(recipe=r, rollout=ro, prompts=prompts, step=step, observer=observer)
                )
        with t("logging"):
            events = [e.as_dict() for e in parts.state.warnings.update(step, metrics)]
            dump_tokens(recipe=r, trainer=tr, run_dir=run_dir, step=step, batch=batch, old=old, adv=adv)
    metrics.update(t.times)
    metrics["time/step_cpu"] = plumbing.process_tree_cpu_seconds() - cpu
    return metrics, events


# ------------------------------------------------------------------------------------ step helpers


def offpolicy_samples(parts: Prepared, *, recipe: Recipe, step: int, timer, observer: StepObserver):
    """An off-policy step's samples (:mod:`tim_megatron.rl.offpolicy`): sample the batches not sampled yet up to
    step + k with the current weights and score each with the trainer at once (pi_s, with the sync and exact
    checks an on-policy step runs), then take the batch this step trains and score it at the current weights
    (pi_t). Returns (batch, its sampling step's metrics, probe sequences, its trainer pass, and with
    ``rollout.schedule: overlapped`` the batches of later steps being sampled beside the update, else None)."""
    r, tr, ro, t = recipe, parts.trainer, parts.rollout, timer
    pending = parts.state.pending
    todo = pending.to_sample(step)
    later = [s for s in todo if s > step] if r.rollout.schedule == "overlapped" else []
    sampled = []
    with t("rollout"):
        for s in (s for s in todo if s not in later):
            sampled.append(
                (
                    s,
                    *phases.rollouts(
                        recipe=r, trainer=tr, rollout=ro, prompts=parts.prompts, step=s, observer=observer
                    ),
                )
            )
        moved = parts.colocation.to_trainer()
    ahead = start_ahead(parts, recipe=r, step=step, steps=later) if later else None
    with contextlib.ExitStack() as on_error:  # a failure here still lets the engine end its generation
        if ahead is not None:
            on_error.callback(ahead.wait)
        with t("old_logprobs"):
            for one in sampled:
                scored = phases.scored_as_sampled(
                    recipe=r, trainer=tr, rollout=ro, sync=parts.sync, sampled=one, step=step, observer=observer,
                    keep_pass=True,
                )  # fmt: skip
                pending.add(scored)
            g = pending.take(step)
            old = phases.current_logprobs(
                trainer=tr,
                batch=g.batch,
                behaviour=g.behaviour,
                sampled=g.old_pass,
                age=g.age(step),
                sampled_routing=g.routing,
            )
        on_error.pop_all()  # it went well: the step joins the generation after the update
    return g.batch, {**g.metrics, **moved}, g.probe, old, ahead


def dump_tokens(*, recipe, trainer, run_dir: Path, step: int, batch, old, adv) -> None:
    """Every token of the step, with its logprobs, to ``dumps/step_N.parquet`` (every ``diagnostics.dumps.every``
    steps, and the first)."""
    from tim_megatron.logging.dumps import write_dump

    d = recipe.diagnostics.dumps
    if not d.every or (
        step % d.every and step != 1
    ):  # the first step too: the report compares early and late
        return
    local = {
        "row": batch.row,
        "engine": batch.engine,
        "finish": batch.finish,
        "mask": batch.response_mask,
        "input_ids": batch.input_ids,
        "train": old.old if old.recomputed else None,
        "infer": old.rollout,
        "old": old.old,
        "sampled": old.behaviour,
        "adv": adv,
        "rewards": batch.rewards,
        "routed": batch.routed_experts if d.routed_experts else None,
        "version": batch.token_version
        if batch.token_version is not None
        else torch.where(batch.response_mask, step - 1 - old.age, -1),
    }
    rows = _gather_rows(trainer, local)
    if trainer.is_rank0:
        write_dump(
            run_dir / "dumps" / f"step_{step:08d}.parquet",
            root=run_dir,
            step=step,
            mask=rows["mask"],
            input_ids=rows["input_ids"],
            train_lp=rows["train"],
            infer_lp=rows["infer"],
            old_lp=rows["old"],
            advantages=rows["adv"],
            rewards=rows["rewards"],
            rows=rows["row"],
            group_size=batch.group_size,
            engine=rows["engine"],
            finish=rows["finish"],
            routed=rows["routed"],
            max_tokens=d.max_tokens,
            seed=recipe.run.seed,
            sampled_lp=rows["sampled"],
            version=rows["version"],
        )


def _gather_rows(tr, local: dict) -> dict:
    """Every data-parallel rank's rows on rank 0, in global row order, padded to the widest (None elsewhere)."""
    import torch.distributed as dist

    parts = [local]
    if dist.is_initialized() and tr.dp_size > 1:
        from megatron.core import parallel_state as ps

        parts = [None] * tr.dp_size
        dist.all_gather_object(parts, local, group=ps.get_data_parallel_group())

    def cat(key: str):
        vals = [p[key] for p in parts]
        if vals[0] is None:
            return None
        if key == "routed":  # [layers, rows, width, k]
            return cat_padded(vals, pad_dim=2, cat_dim=1)
        return cat_padded(vals, pad_dim=1, cat_dim=0)

    out = {k: cat(k) for k in local}
    order = torch.argsort(out["row"])
    for k, v in out.items():
        if v is not None:
            out[k] = v[:, order] if k == "routed" else v[order]
    return out


def log_step(tracker, *, recipe, step: int, metrics: dict, events: list, is_rank0: bool) -> None:
    if not is_rank0:
        return
    tracker.log(step, metrics, events=events)
    if recipe.logging.console and tracker.console is not None:
        tracker.console.print(
            recorded(tracker.summary_line(step, recipe.run.steps, metrics), 2000),
            highlight=False,
            soft_wrap=True,
        )
        for e in events:
            tracker.console.print(
                f"[bold yellow]early warning[/]: {recorded(e['kind'])} of {recorded(e['metric'])} at step "
                f"{recorded(e['step'])} ({e['value']:.3g} vs baseline {e['baseline']:.3g})",
                highlight=False,
            )


def should_checkpoint(recipe, step: int) -> bool:
    every = recipe.checkpoint.every
    return bool(every) and step % every == 0 and step != recipe.run.steps


def save(parts: Prepared, *, run_dir: Path, recipe, step: int, overwrite: bool = True, view=None) -> Path:
    """Checkpoint the trainer and the loop's state after ``step`` (``view``: the loop's state as
    :meth:`~tim_megatron.run_state.LoopState.checkpoint_view` kept it; None: as it is now)."""
    from tim_megatron.trainer.checkpoint import save_checkpoint, step_dir

    if not overwrite and (step_dir(run_dir / "checkpoints", step) / "state.json").exists():
        return step_dir(run_dir / "checkpoints", step)
    loop = parts.state if view is None else view
    with parts.colocation.resident():  # between steps the optimizer state may be in host memory
        return save_checkpoint(
            parts.trainer,
            run_dir / "checkpoints",
            step=step,
            state=loop.state_dict(),
            keep=recipe.checkpoint.keep,
            rank_state=loop.rank_state(),
        )


@dataclass
class RunFolder:
    """What rank 0 writes in the run folder besides metrics and checkpoints: progress in ``run.json``, and at the
    end the summary and the early-warning events."""

    run_dir: Path
    loaded: LoadedRecipe
    is_rank0: bool

    def record_progress(self, step: int) -> OSError | None:
        """Rank 0 records the step reached in ``run.json``; the error when the folder refused it (None elsewhere)."""
        if not self.is_rank0:
            return None
        try:
            record_step(self.run_dir, step)
        except OSError as e:
            return e
        return None

    def finish(self, parts: Prepared, step: int, seconds: float, *, status: str) -> None:
        from tim_megatron.logging.summary import write_summary
        from tim_megatron.logging.tracker import read_metrics
        from tim_megatron.run_dir import mark_finished

        tracker, events = parts.tracker, [e.as_dict() for e in parts.state.warnings.events]
        if self.is_rank0:
            rows = read_metrics(self.run_dir / "metrics.jsonl")
            text = write_summary(
                self.run_dir, rows, name=self.loaded.name, wall_seconds=seconds, events=events
            )
            write_atomic(self.run_dir / "events.json", json.dumps(events, indent=1), root=self.run_dir)
            mark_finished(
                self.run_dir,
                status,
                step=step,
                wall_seconds=seconds,
                max_requeues=self.loaded.recipe.cluster.max_requeues,
            )
            if tracker.console is not None:
                tracker.console.print(recorded(text, 100_000, lines=True), highlight=False)
        tracker.close()
