"""The overlapped off-policy schedule (``rollout.schedule: overlapped``): a later step's batch is sampled on a
thread while the trainer updates.

At step t (weights theta_{t-1}; the engine holds the same, verified at the last sync) the sequential schedule
samples B_{t+k}, scores it (pi_s), then trains B_t. The overlapped one starts B_{t+k}'s generation on a thread and
trains B_t at once; the update changes the trainer's weights, not the engine's, which keeps theta_{t-1} until the
step's sync. After the update the thread is joined, the batch is finished on the main thread (rewards and the
collectives of :func:`~tim_megatron.rl.phases.rollouts`), and pi_s is computed from a copy of theta_{t-1} taken
before the update (:meth:`~tim_megatron.trainer.megatron_trainer.MegatronTrainer.weights_at`), with the same sync
check. Every number is the sequential schedule's: the same weights sample the same prompts with the same seeds and
score them with the same weights; only the order in time differs (``tests/test_offpolicy.py`` compares the two).

What runs on the thread touches the engine alone (:func:`~tim_megatron.rl.phases.sample_block`): no collective,
no tokenizer, no trainer. The price: one copy of the trainer's weights, and the engine and the trainer resident at
once (the recipe rules refuse offloading and sleeping with this schedule).

Partial rollouts (:mod:`tim_megatron.rl.partial`) run the same way: the step's call for the batch it trains runs
first, on the main thread, and the calls that advance the later batches run on the thread beside the update
(:func:`start_ahead_calls`); after it they are merged and scored from the copy of the sampling weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tim_megatron.observer import StepObserver
from tim_megatron.rl import phases
from tim_megatron.rl.offpolicy import Pending
from tim_megatron.rollout.faults import agreed


@dataclass
class Ahead:
    """The batches of later steps being sampled beside this step's update, and the weights that sample them."""

    step: int
    """The step during whose update they are sampled (its weights, ``step - 1`` updates, sample them)."""
    snapshot: dict
    """The trainer's weights at that step's start (pi_s is scored with them after the update)."""
    running: list[tuple[int, Future]] = field(default_factory=list)
    """(the step a batch is for, its generation on the thread)."""
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tim-ahead"), repr=False
    )
    finisher: Callable | None = field(default=None, repr=False)
    """Partial rollouts: what finishes the joined calls (:func:`tim_megatron.rl.partial.finish_ahead`); None:
    the batches of later steps, added to the pending ones."""
    picks: dict[int, list[int]] = field(default_factory=dict, repr=False)
    """Partial rollouts: the rows each call advances, by batch."""
    tally: object | None = field(default=None, repr=False)
    """Partial rollouts: the step's tally, which the calls beside the update complete."""

    def wait(self) -> None:
        """Let every generation end, whatever happens to the step (the engine is not left mid-generation)."""
        self.pool.shutdown(wait=True)

    def finish(self, parts, *, recipe, pending: Pending, observer: StepObserver) -> dict[str, float]:
        """Join the thread, finish each batch on this thread and score it at the sampling weights; add them to
        ``pending``. Returns the overlap's metrics."""
        tr, ro = parts.trainer, parts.rollout
        t0 = time.perf_counter()
        results = agreed(parts.rollout, lambda: [(s, f.result()) for s, f in self.running], phase="generate")
        self.pool.shutdown(wait=True)
        waited = time.perf_counter() - t0
        overlap = {
            "offpolicy/overlap_generate_seconds": sum(out[1].seconds for _, out in results),
            "offpolicy/overlap_wait_seconds": waited,
        }
        if self.finisher is not None:
            joined = [(s, self.picks[s], out) for s, out in results]
            return {
                **self.finisher(
                    parts, recipe=recipe, step=self.step, snapshot=self.snapshot, results=joined,
                    tally=self.tally, observer=observer,
                ),
                **overlap,
            }  # fmt: skip
        for s, sampled in results:
            finished = phases.rollouts(
                recipe=recipe,
                trainer=tr,
                rollout=ro,
                prompts=parts.prompts,
                step=s,
                observer=observer,
                sampled=sampled,
            )
            with tr.weights_at(self.snapshot):  # the weights it was sampled with, not the updated ones
                scored = phases.scored_as_sampled(
                    recipe=recipe, trainer=tr, rollout=ro, sync=parts.sync, sampled=(s, *finished),
                    step=self.step, observer=observer, keep_pass=False,
                )  # fmt: skip
            pending.add(scored)
        return overlap


def start_ahead(parts, *, recipe, step: int, steps: list[int]) -> Ahead:
    """Snapshot the trainer's weights and start sampling the batches of ``steps`` on a thread with the engine's
    (the same weights, verified at the last sync). One thread: the engine runs one generation at a time."""
    ahead = Ahead(step=step, snapshot=parts.trainer.weights_snapshot())
    for s in steps:
        call = phases.sample_block(recipe=recipe, rollout=parts.rollout, prompts=parts.prompts, step=s)
        ahead.running.append((s, ahead.pool.submit(call)))
    return ahead


def start_ahead_calls(
    parts, *, step: int, calls: list[tuple[int, list[int], Callable]], finisher, tally
) -> Ahead:
    """Partial rollouts: snapshot the trainer's weights and run ``calls`` ((batch, its rows advanced, the call that
    touches the engine alone) each), in order, on a thread; ``finisher`` merges and scores them after the update."""
    ahead = Ahead(step=step, snapshot=parts.trainer.weights_snapshot(), finisher=finisher, tally=tally)
    for s, picks, call in calls:
        ahead.picks[s] = picks
        ahead.running.append((s, ahead.pool.submit(call)))
    return ahead
