"""The RL loop: rollout, rewards, advantages, old logprobs, mismatch metrics, update, weight sync, log.

One function, :func:`train`, reading top to bottom; the phases are in ``tim_megatron.rl.phases``.
The same loop runs ``make demo`` on a laptop CPU and the 30B Slurm jobs.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from tim_megatron.recipe import LoadedRecipe
from tim_megatron.rl import phases
from tim_megatron.rl.batch import broadcast_object
from tim_megatron.run_dir import RunDirNotWritable, record_step
from tim_megatron.run_state import Run
from tim_megatron.stop import EXIT_PREEMPTED, StopRequest


def train(
    loaded: LoadedRecipe,
    run_dir: Path,
    *,
    resume: bool = False,
    console=None,
    trust_unverified: bool = False,
    stop: StopRequest | None = None,
) -> int:
    """Run (or resume) the recipe in ``run_dir``; returns the process exit code.

    ``trust_unverified`` loads a checkpoint written before checksums were recorded (refused otherwise).
    ``stop``: the caller's installed stop request (see :mod:`tim_megatron.stop`).
    """
    from tim_megatron.logging.library_log import routed
    from tim_megatron.run_setup import setup

    # the libraries' own output (start-up included) goes to logs/engine.log, the console keeps the step lines
    with routed(run_dir, level=loaded.recipe.logging.engine_level, console=console):
        run = setup(
            loaded, run_dir, resume=resume, console=console, trust_unverified=trust_unverified, stop=stop
        )
        return run_steps(run)


def run_steps(run: Run) -> int:
    """The steps of a prepared run, from ``run.start_step``: generate, score, recompute, update, sync, log."""
    r = run.recipe
    run.stop.steps_begin()  # from here a SIGTERM ends the step and checkpoints
    t_start = time.perf_counter()
    step = run.start_step - 1
    try:
        for step in range(run.start_step, r.run.steps + 1):
            t = phases.Timer()
            with t("step"):
                with t("rollout"):
                    batch, metrics, probe = phases.rollouts(run, step)
                    metrics.update(run.colocation.to_trainer())
                with t("old_logprobs"):
                    old = phases.old_logprobs(run, batch, step)
                    metrics.update(old.sync)
                    adv = phases.advantages(run, batch)
                with t("metrics"):
                    tim, weights, _ = phases.tim_metrics(run, batch, old, adv, step)
                    metrics.update(tim)
                run.schedule.observe(step, metrics)
                lr = run.schedule.lr(step)
                with t("update"):
                    metrics.update(phases.update(run, batch, old, adv, weights, lr, step))
                with t("sync"):
                    metrics.update(sync_weights(run, probe, last=step == r.run.steps))
                if r.run.val_every and (step % r.run.val_every == 0 or step == r.run.steps):
                    with t("validation"):
                        metrics.update(validate(run, step))
                with t("logging"):
                    events = [e.as_dict() for e in run.warnings.update(step, metrics)]
                    dump_tokens(run, step, batch, old, adv)
            metrics.update(t.times)
            if step == run.start_step:
                metrics.update(run.info)
            log_step(run, step, metrics, events)
            unwritable = record_progress(run, step)  # rank 0: a folder that refuses writes stops the run now
            stop, write_error = broadcast_object((run.stop.requested, unwritable and str(unwritable)))
            if write_error:
                raise unwritable or RunDirNotWritable(
                    f"rank 0 could not write in {run.run_dir}: {write_error}"
                )
            if stop or should_checkpoint(run, step):  # one write when both fall on the same step
                save(run, step)
            if stop:
                finish(run, step, time.perf_counter() - t_start, status="preempted")
                return EXIT_PREEMPTED
    except BaseException as e:
        from tim_megatron.run_dir import mark_failed
        from tim_megatron.trainer.engine import NonFiniteAbort

        if isinstance(e, NonFiniteAbort):  # its updates were skipped: the weights are the last good ones
            e.args = (f"{e}; last good state checkpointed: {save(run, step - 1, overwrite=False)}",)
        if run.is_rank0:
            with contextlib.suppress(OSError):  # an unwritable run.json: the caller's attempt() says so
                mark_failed(run.run_dir, e, step=step)
        run.tracker.close()
        raise
    if r.run.steps >= run.start_step:
        save(run, r.run.steps)
    finish(run, r.run.steps, time.perf_counter() - t_start, status="completed")
    return 0


# ------------------------------------------------------------------------------------ step helpers


def sync_weights(run: Run, probe: list[list[int]] | None = None, *, last: bool = False) -> dict:
    """Push the updated weights into every engine and verify them (now on a probe, or on the next step's data).

    ``probe``: this engine's own sequences from the step (likely tokens give the check its power); distinct
    prompts, because a router near-tie on one prompt moves all of its samples together."""
    return run.colocation.to_rollout(probe=lambda: probe or run.probe, last=last)


def validate(run: Run, step: int) -> dict:
    """Greedy accuracy on the validation prompts, each engine taking its block of them."""
    from tim_megatron.data.rewards import reward
    from tim_megatron.data.sources import encode_prompt
    from tim_megatron.rl.phases import _sum_over_engines

    items = run.source.validation_items(run.recipe.data.val_prompts)
    if not items:
        return {}
    ro = run.rollout
    block = ro.layout.block(len(items), ro.engine_index)
    mine = [items[i] for i in block]
    prompts = [encode_prompt(run.tokenizer, it.prompt) for it in mine]
    groups, _ = ro.generate(prompts, step=step, first_index=block.start, n=1, greedy=True)
    correct = sum(
        reward(it.reward, run.tokenizer.decode(g[0].response_ids, skip_special_tokens=True), it.answer)
        for it, g in zip(mine, groups, strict=True)
    )
    (total,) = _sum_over_engines(ro, [float(correct)])
    return {"val/accuracy": total / len(items)}


def dump_tokens(run: Run, step: int, batch, old, adv) -> None:
    from tim_megatron.logging.dumps import write_dump

    d = run.recipe.diagnostics.dumps
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
        "adv": adv,
        "rewards": batch.rewards,
        "routed": batch.routed_experts if d.routed_experts else None,
    }
    rows = _gather_rows(run.trainer, local)
    if run.is_rank0:
        write_dump(
            run.run_dir / "dumps" / f"step_{step:08d}.parquet",
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
            seed=run.recipe.run.seed,
        )


def _gather_rows(tr, local: dict) -> dict:
    """Every data-parallel rank's rows on rank 0, in global row order, padded to the widest (None elsewhere)."""
    import torch.distributed as dist

    parts = [local]
    if dist.is_initialized() and tr.dp_size > 1:
        from megatron.core import parallel_state as ps

        parts = [None] * tr.dp_size
        dist.all_gather_object(parts, local, group=ps.get_data_parallel_group())
    width = max(p["mask"].shape[1] for p in parts)

    def cat(key: str):
        vals = [p[key] for p in parts]
        if vals[0] is None:
            return None
        dim = {"routed": 2}.get(key, 1)
        padded = []
        for v in vals:
            if v.dim() > dim and v.shape[dim] < width:
                shape = list(v.shape)
                shape[dim] = width - v.shape[dim]
                v = torch.cat([v, torch.zeros(shape, dtype=v.dtype)], dim)
            padded.append(v)
        return torch.cat(padded, 1 if key == "routed" else 0)

    out = {k: cat(k) for k in local}
    order = torch.argsort(out["row"])
    for k, v in out.items():
        if v is not None:
            out[k] = v[:, order] if k == "routed" else v[order]
    return out


def log_step(run: Run, step: int, metrics: dict, events: list) -> None:
    if not run.is_rank0:
        return
    run.tracker.log(step, metrics, events=events)
    if run.recipe.logging.console and run.tracker.console is not None:
        run.tracker.console.print(
            run.tracker.summary_line(step, run.recipe.run.steps, metrics), highlight=False, soft_wrap=True
        )
        for e in events:
            run.tracker.console.print(
                f"[bold yellow]early warning[/]: {e['kind']} of {e['metric']} at step {e['step']} "
                f"({e['value']:.3g} vs baseline {e['baseline']:.3g})",
                highlight=False,
            )


def record_progress(run: Run, step: int) -> OSError | None:
    """Rank 0 records the step reached in ``run.json``; the error when the folder refused it (None elsewhere)."""
    if not run.is_rank0:
        return None
    try:
        record_step(run.run_dir, step)
    except OSError as e:
        return e
    return None


def should_checkpoint(run: Run, step: int) -> bool:
    every = run.recipe.checkpoint.every
    return bool(every) and step % every == 0 and step != run.recipe.run.steps


def save(run: Run, step: int, *, overwrite: bool = True) -> Path:
    from tim_megatron.trainer.checkpoint import save_checkpoint, step_dir

    if not overwrite and (step_dir(run.run_dir / "checkpoints", step) / "state.json").exists():
        return step_dir(run.run_dir / "checkpoints", step)
    state = {"schedule": run.schedule.state_dict(), "warnings": run.warnings.state_dict()}
    with run.colocation.resident():  # between steps the optimizer state may be in host memory
        return save_checkpoint(
            run.trainer, run.run_dir / "checkpoints", step=step, state=state, keep=run.recipe.checkpoint.keep
        )


def finish(run: Run, step: int, seconds: float, *, status: str) -> None:
    from tim_megatron.logging.summary import write_summary
    from tim_megatron.logging.tracker import read_metrics
    from tim_megatron.run_dir import mark_finished

    if run.is_rank0:
        rows = read_metrics(run.run_dir / "metrics.jsonl")
        text = write_summary(
            run.run_dir,
            rows,
            name=run.loaded.name,
            wall_seconds=seconds,
            events=[e.as_dict() for e in run.warnings.events],
        )
        (run.run_dir / "events.json").write_text(
            json.dumps([e.as_dict() for e in run.warnings.events], indent=1)
        )
        mark_finished(
            run.run_dir, status, step=step, wall_seconds=seconds, max_requeues=run.recipe.cluster.max_requeues
        )
        if run.tracker.console is not None:
            run.tracker.console.print(text, highlight=False)
    run.tracker.close()
