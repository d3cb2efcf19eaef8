"""The RL loop: rollout, rewards, advantages, old logprobs, mismatch metrics, update, weight sync, log.

One function, :func:`train`, reading top to bottom; the phases are in ``tim_megatron.rl.phases``.
The same loop runs ``make demo`` on a laptop CPU and the 30B Slurm jobs.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tim_megatron.algo import EarlyWarning, SurgeDetector, build_schedule
from tim_megatron.recipe import LoadedRecipe
from tim_megatron.rl import phases
from tim_megatron.rl.batch import broadcast_object

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpoint written, resume me (the Slurm script requeues on it)


@dataclass
class StopRequest:
    """Set by SIGTERM/SIGINT; the loop finishes its step, checkpoints and exits."""

    requested: bool = False
    signal: int | None = None

    def install(self) -> None:
        def handler(signum, _frame):
            self.requested, self.signal = True, signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


@dataclass
class Run:
    loaded: LoadedRecipe
    run_dir: Path
    trainer: object
    engine: object | None
    source: object
    tokenizer: object
    schedule: object
    warnings: EarlyWarning
    tracker: object
    manifest: dict | None
    stop: StopRequest
    capture_agreement: bool
    start_step: int = 1
    sample_texts: list = field(default_factory=list)
    probe: list = field(default_factory=list)
    """Fallback probe sequences for weight-sync verification (a step's own samples are used when present)."""
    info: dict = field(default_factory=dict)
    """Remedy flags logged with the first step."""
    synced_once: bool = False
    verify_on_next_step: bool = False
    """The last sync is checked against the trainer's logprobs on the next step's samples."""
    last_sync_check: object | None = None
    """That check's agreement (rollout.sync.Agreement), logged with the step that ran it."""

    @property
    def recipe(self):
        return self.loaded.recipe

    @property
    def is_rank0(self) -> bool:
        return self.trainer.is_rank0


def train(loaded: LoadedRecipe, run_dir: Path, *, resume: bool = False, console=None) -> int:
    """Run (or resume) the recipe in ``run_dir``; returns the process exit code."""
    from tim_megatron.run_setup import setup

    run = setup(loaded, run_dir, resume=resume, console=console)
    r = run.recipe
    t_start = time.perf_counter()
    step = run.start_step - 1
    try:
        for step in range(run.start_step, r.run.steps + 1):
            t = phases.Timer()
            with t("step"):
                with t("rollout"):
                    batch, metrics = phases.rollouts(run, step)
                with t("old_logprobs"):
                    old = phases.old_logprobs(run, batch, step)
                    if run.last_sync_check is not None:
                        ag, run.last_sync_check = run.last_sync_check, None
                        metrics["sync/data_p80_abs_prob_diff"] = ag.p80_abs_prob_diff
                        metrics["sync/data_mean_abs_prob_diff"] = ag.mean_abs_prob_diff
                        metrics["sync/data_max_abs_prob_diff"] = ag.max_abs_prob_diff
                        metrics["sync/data_frac_above_tolerance"] = ag.frac_above
                    adv = phases.advantages(run, batch)
                with t("metrics"):
                    tim, weights, _ = phases.tim_metrics(run, batch, old, adv, step)
                    metrics.update(tim)
                run.schedule.observe(step, metrics)
                lr = run.schedule.lr(step)
                with t("update"):
                    metrics.update(phases.update(run, batch, old, adv, weights, lr, step))
                with t("sync"):
                    metrics.update(sync_weights(run, batch, last=step == r.run.steps))
                if r.run.val_every and (step % r.run.val_every == 0 or step == r.run.steps):
                    with t("validation"):
                        metrics.update(validate(run, step))
                with t("logging"):
                    events = [e.as_dict() for e in run.warnings.update(step, metrics)]
                    dump_tokens(run, step, batch, old, adv)
            metrics.update(t.times)
            if step == 1:
                metrics.update(run.info)
            log_step(run, step, metrics, events)
            stop = broadcast_object(run.stop.requested)
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
            mark_failed(run_dir, e, step=step)
        run.tracker.close()
        raise
    if r.run.steps >= run.start_step:
        save(run, r.run.steps)
    finish(run, r.run.steps, time.perf_counter() - t_start, status="completed")
    return 0


# ------------------------------------------------------------------------------------ step helpers


def sync_weights(run: Run, batch=None, *, last: bool = False) -> dict:
    """Push the updated weights into the rollout engine; verify them now (probe) or on the next step's data."""
    from tim_megatron.rollout.sync import sync_and_verify

    r = run.recipe
    if r.diagnostics.vexact == "trainer_sampler":
        return {}
    check = r.rollout.sync_check
    first = not run.synced_once
    eager = check == "probe" or (check in ("every", "first") and first) or (check == "every" and last)
    probe = None
    if eager:  # this step's own samples: likely tokens give the check its power
        probe = (
            [
                batch.input_ids[i, : int(batch.lengths[i])].tolist()
                for i in probe_rows(len(batch), batch.group_size, run.trainer.dp_size)
            ]
            if batch is not None
            else run.probe
        )
    rep = sync_and_verify(
        run.engine, run.trainer, expected=run.manifest, probe=probe, tolerance=r.sync_tolerance, dtype=None
    )
    run.synced_once = True
    run.verify_on_next_step = check == "every" and not last
    out = {"sync/seconds": rep.seconds, "sync/mbytes": rep.bytes / 2**20, "sync/tensors": rep.tensors}
    if eager and rep.agreement is not None:
        out.update(
            {
                "sync/verify_seconds": rep.verify_seconds,
                "sync/probe_p80_abs_prob_diff": rep.agreement.p80_abs_prob_diff,
                "sync/probe_mean_abs_prob_diff": rep.agreement.mean_abs_prob_diff,
                "sync/probe_max_abs_prob_diff": rep.agreement.max_abs_prob_diff,
            }
        )
    return out


def probe_rows(n: int, group_size: int, dp: int, want: int = 8) -> list[int]:
    """Rows of a step for an eager sync check: one sample of each of up to ``want`` prompts, a multiple of ``dp``.

    Distinct prompts, because a router near-tie on one prompt moves all of its samples together and would
    decide the verdict alone."""
    firsts = list(range(0, n, group_size))[:want]
    k = len(firsts) // dp * dp
    return firsts[:k] if k else list(range(min(n, dp)))


def validate(run: Run, step: int) -> dict:
    """Greedy accuracy on the validation prompts (rank 0 generates; everyone gets the number)."""
    from tim_megatron.data.rewards import reward
    from tim_megatron.data.sources import encode_prompt

    acc = None
    items = run.source.validation_items(run.recipe.data.val_prompts)
    if run.engine is not None and items:
        prompts = [encode_prompt(run.tokenizer, it.prompt) for it in items]
        groups, _ = run.engine.generate(prompts, step=step, n=1, greedy=True)
        acc = sum(
            reward(it.reward, run.tokenizer.decode(g[0].response_ids, skip_special_tokens=True), it.answer)
            for it, g in zip(items, groups, strict=True)
        ) / len(items)
    acc = broadcast_object(acc)
    return {} if acc is None else {"val/accuracy": acc}


def dump_tokens(run: Run, step: int, batch, old, adv) -> None:
    from tim_megatron.logging.dumps import write_dump

    d = run.recipe.diagnostics.dumps
    if not d.every or (
        step % d.every and step != 1
    ):  # the first step too: the report compares early and late
        return
    gathered = _gather_rows(
        run.trainer, {"train": old.old if old.recomputed else None, "infer": old.rollout, "old": old.old}
    )
    if run.is_rank0:
        write_dump(
            run.run_dir / "dumps" / f"step_{step:08d}.parquet",
            step=step,
            mask=batch.response_mask,
            input_ids=batch.input_ids,
            train_lp=gathered["train"],
            infer_lp=gathered["infer"],
            old_lp=gathered["old"],
            advantages=adv,
            rewards=batch.rewards,
            routed=batch.routed_experts if d.routed_experts else None,
            max_tokens=d.max_tokens,
            seed=run.recipe.run.seed,
        )


def _gather_rows(tr, tensors: dict) -> dict:
    import torch.distributed as dist

    if not (dist.is_initialized() and tr.dp_size > 1):
        return tensors
    from megatron.core import parallel_state as ps

    out = {}
    for k, v in tensors.items():
        if v is None:
            out[k] = None
            continue
        parts = [torch.empty_like(v) for _ in range(tr.dp_size)]
        dist.all_gather(parts, v.contiguous(), group=ps.get_data_parallel_group())
        out[k] = torch.cat(parts)
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


def should_checkpoint(run: Run, step: int) -> bool:
    every = run.recipe.checkpoint.every
    return bool(every) and step % every == 0 and step != run.recipe.run.steps


def save(run: Run, step: int, *, overwrite: bool = True) -> Path:
    from tim_megatron.trainer.checkpoint import save_checkpoint, step_dir

    if not overwrite and (step_dir(run.run_dir / "checkpoints", step) / "state.json").exists():
        return step_dir(run.run_dir / "checkpoints", step)
    state = {"schedule": run.schedule.state_dict(), "warnings": run.warnings.state_dict()}
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


def new_warnings(recipe) -> EarlyWarning:
    ew = recipe.diagnostics.early_warning
    sv = recipe.remedies.lr_schedule.surge
    return EarlyWarning.create(
        metrics=list(ew.metrics),
        baseline_steps=ew.baseline_steps,
        window=ew.window,
        threshold=ew.threshold,
        surge=SurgeDetector(window=sv.window, baseline_steps=sv.baseline_steps, factor=sv.factor),
    )


def new_schedule(recipe):
    return build_schedule(recipe.remedies.lr_schedule, base_lr=recipe.optim.lr, total_steps=recipe.run.steps)
