"""Everything a run needs before its first step: model, trainer, rollout engine, data, logging, resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tim_megatron.recipe import LoadedRecipe
from tim_megatron.untrusted import recorded

if TYPE_CHECKING:  # the parts' types; importing them starts megatron-core and vLLM
    from tim_megatron.data.sources import PromptSource
    from tim_megatron.logging.tracker import Tracker
    from tim_megatron.rl.colocation import Colocation
    from tim_megatron.rollout.base import RolloutEngine
    from tim_megatron.rollout.sync import WeightSync
    from tim_megatron.run_state import LoopState
    from tim_megatron.stop import StopRequest
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer


def model_path_for(recipe) -> Path:
    """The HF checkpoint folder: the built-in tiny model (built on first use) or ``model.path``."""
    if recipe.model.path == "tiny":
        from tim_megatron.models.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint(
            recipe.model.dims,
            seed=recipe.model.tiny_seed,
            warmup_steps=recipe.model.tiny_warmup_steps,
            task=recipe.data.task,
        )
    p = Path(recipe.model.path)
    if p.exists():
        return p
    if "/" in recipe.model.path and not recipe.model.path.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(
                    recipe.model.path,
                    allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"],
                )
            )
        except Exception as e:
            raise FileNotFoundError(
                f"model.path = {recipe.model.path}: not a local folder, and the hub download failed ({e})"
            ) from None
    raise FileNotFoundError(f"model.path = {recipe.model.path}: no such checkpoint folder")


def build_rollout(recipe, trainer, *, model_path: Path, tokenizer):
    """This rank's rollout engine, from the recipe's backend (:mod:`tim_megatron.rollout.backends`)."""
    from tim_megatron.rollout.backends import backend_for

    return backend_for(trainer.modes.backend).build(
        recipe, trainer, model_path=model_path, tokenizer=tokenizer
    )


@dataclass
class Prepared:
    """What :func:`setup` builds for the loop, each part its own object: the loop hands every phase the parts it
    needs, by name."""

    trainer: MegatronTrainer
    """This rank's Megatron model, optimizer and logprob passes."""
    rollout: RolloutEngine
    """This rank's rollout engine (its share of the vLLM fleet, or the exact sampler)."""
    sync: WeightSync
    """The weight sync from the trainer into the engines and its verification."""
    colocation: Colocation
    """Who holds the accelerator memory when: the one place that sleeps, wakes and moves state."""
    prompts: PromptSource
    """The step's and validation's prompts, with the tokenizer that encodes them and decodes the responses."""
    tracker: Tracker
    """metrics.jsonl, wandb and the console (enabled on rank 0)."""
    state: LoopState
    """The schedule, the early warnings and the first step: what a checkpoint restores besides the model."""
    stop: StopRequest
    """The installed stop request: a signal ends the step and checkpoints."""
    probe: list[list[int]]
    """Fallback probe sequences for the eager sync check (a step's own samples are used when present)."""
    first_step_info: dict[str, float]
    """Remedy flags and the fleet size, logged with the first step."""

    def close(self) -> None:
        """Release the engine, then the trainer (the engine joined the trainer's process groups), so another run
        can start in this process."""
        self.rollout.close()
        self.trainer.close()


def _resume_from(run_dir: Path, *, trust_unverified: bool) -> Path | None:
    """The checkpoint a resumed run starts from: the latest good one (corrupt ones skipped; the ranks share the
    hashing), refused when unsafe. Checked before any engine starts."""
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint, refuse_unsafe

    ckpt = latest_good_checkpoint(run_dir / "checkpoints", trust_unverified=trust_unverified)
    if ckpt is not None:
        refuse_unsafe(ckpt)
    return ckpt


def _restore(ckpt: Path, *, trainer, state, run_dir: Path, recipe, prompts) -> None:
    """Load the checkpoint into the trainer and the loop state, and check the batches it holds sampled ahead (each
    row's prompt and reward are its step's); the metrics after its step are dropped."""
    import torch.distributed as dist

    from tim_megatron.logging.tracker import truncate_jsonl
    from tim_megatron.rl.offpolicy import StalenessError
    from tim_megatron.rl.partial import PartialRollouts, stored_prompts_disagree
    from tim_megatron.rl.phases import stored_rows_disagree
    from tim_megatron.trainer.checkpoint import load_checkpoint, load_rank_state, rank_state_file

    meta = load_checkpoint(trainer, ckpt)
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = str(rank_state_file(ckpt, rank))
    total = recipe.data.prompts_per_step * recipe.rollout.n
    state.load_state_dict(
        meta["state"],
        step=meta["step"],
        rank_state=load_rank_state(ckpt, rank),
        where=where,
        total_rows=total,
        group_size=recipe.rollout.n,
        first_row=trainer.dp_rank * (total // trainer.dp_size),
    )
    for s, g in sorted(state.pending.batches.items()) if state.pending is not None else ():
        if isinstance(state.pending, PartialRollouts):  # rows in flight: prompts only, no reward yet
            wrong = stored_prompts_disagree(
                g, prompts=prompts, prompts_per_step=recipe.data.prompts_per_step, group_size=recipe.rollout.n
            )
        else:
            wrong = stored_rows_disagree(
                batch=g.batch, prompts=prompts, step=s, prompts_per_step=recipe.data.prompts_per_step
            )
        if wrong:
            raise StalenessError(
                f"{where}: step {s}'s pending batch is not what step {s} sampled: {wrong}; the file was changed "
                "after it was written (resume from an earlier checkpoint)"
            )
    if trainer.is_rank0:
        truncate_jsonl(run_dir / "metrics.jsonl", after_step=meta["step"])


def setup(
    loaded: LoadedRecipe,
    run_dir: Path,
    *,
    resume: bool,
    console=None,
    trust_unverified: bool = False,
    stop=None,
) -> Prepared:
    """``stop``: the installed :class:`tim_megatron.stop.StopRequest` of ``tim train`` (a signal during
    start-up stops it at once); without one, a signal waits for the end of the first step."""
    import torch
    from transformers import AutoTokenizer

    from patches.megatron import checkpoint_writer_signals
    from tim_megatron.data.sources import PromptSource
    from tim_megatron.logging.tracker import Tracker
    from tim_megatron.modes import rollout_backend
    from tim_megatron.rl.colocation import Colocation
    from tim_megatron.rl.phases import probe_sequences
    from tim_megatron.rollout.backends import backend_for
    from tim_megatron.rollout.sync import WeightSync, manifest
    from tim_megatron.run_dir import mark_running, resume_note
    from tim_megatron.run_state import LoopState
    from tim_megatron.stop import StopRequest
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    r = loaded.recipe
    if stop is None:
        stop = StopRequest()
        stop.install()
    path = model_path_for(r)
    backend_for(rollout_backend(r)).check_model(  # weights present, servable
        path, on_gpu=torch.cuda.is_available(), tensor_parallel=r.rollout.tensor_parallel_size
    )
    # bad data (and a prompt too long in this tokenizer) fails here, before any engine starts
    prompts = PromptSource(r.data, seed=r.run.seed, tokenizer=AutoTokenizer.from_pretrained(path))
    trainer = MegatronTrainer.of_run(r, model_path=path)
    ckpt = _resume_from(run_dir, trust_unverified=trust_unverified) if resume else None
    checkpoint_writer_signals.shield()  # a job's SIGTERM must not kill megatron's writer helper
    state = LoopState.create(r)
    if ckpt is not None:  # before any engine starts: a checkpoint that cannot continue stops here
        _restore(ckpt, trainer=trainer, state=state, run_dir=run_dir, recipe=r, prompts=prompts)
    rollout = build_rollout(r, trainer, model_path=path, tokenizer=prompts.tokenizer)
    _check_sync_fault(r, rollout)
    sync = WeightSync(r, expected=manifest(path), rank=trainer.rank)
    probe = probe_sequences(prompts=prompts, rollout=rollout, step=1)
    colocation = Colocation(
        rollout=rollout, trainer=trainer, sync=sync, offload=r.trainer.offload_during_rollout
    )
    layout = fleet_description(rollout)
    info = {
        **remedy_info(recipe=r, trainer=trainer, rollout=rollout),
        "rollout/engines": float(rollout.layout.engines),
    }
    # a resumed run's engines start from the checkpoint on disk: they get the resumed weights
    colocation.start(probe=probe, resumed=ckpt is not None)
    tracker = Tracker(  # rank 0 logs
        r, run_dir=run_dir, name=f"{loaded.name}/{run_dir.name}", run_id=_run_id(run_dir), enabled=trainer.is_rank0,
        console=console if trainer.is_rank0 else None,
    )  # fmt: skip
    if trainer.is_rank0:
        meta = mark_running(run_dir, start_step=state.start_step, resumed_from=str(ckpt) if ckpt else None)
        if console is not None:
            _announce(console, loaded, run_dir, trainer=trainer, start=state.start_step, layout=layout)
            if ckpt is not None and (note := resume_note(meta, start_step=state.start_step)):
                console.print(f"  {recorded(note, 1000)}", highlight=False)
    return Prepared(
        trainer=trainer,
        rollout=rollout,
        sync=sync,
        colocation=colocation,
        prompts=prompts,
        tracker=tracker,
        state=state,
        stop=stop,
        probe=probe,
        first_step_info=info,
    )


def _check_sync_fault(recipe, rollout) -> None:
    fault = recipe.diagnostics.sync_fault
    if fault.kind != "off" and fault.engine >= rollout.layout.engines:
        raise ValueError(
            f"diagnostics.sync_fault.engine = {fault.engine}: this job has rollout engines "
            f"0..{rollout.layout.engines - 1}"
        )


def _announce(
    console, loaded: LoadedRecipe, run_dir: Path, *, trainer, start: int, layout: list[str]
) -> None:
    """The console's first lines: the steps ahead, the dtypes, the world, and one line per engine."""
    r = loaded.recipe
    console.print(
        f"[bold]tim train[/] {recorded(loaded.name)}: steps {start:d}..{r.run.steps:d} in {recorded(run_dir)}"
        f" (trainer {recorded(trainer.dtype)}, rollout {recorded(r.rollout_dtype)}, world "
        f"{trainer.env.world_size:d})",
        highlight=False,
    )
    k = trainer.kernels
    console.print(
        f"  trainer kernels: attention {recorded(k.attention)}, experts {recorded(k.experts)}",
        highlight=False,
    )
    if trainer.exact_admission is not None:
        console.print(f"  exact kernels: {recorded(trainer.exact_admission.text(), 1000)}", highlight=False)
    for line in layout:
        console.print(recorded(line, 1000), highlight=False)
    from tim_megatron.recipe.notices import notices

    for n in notices(r):
        console.print(f"  [yellow]notice[/]: {recorded(n, 1000)}", highlight=False)


def fleet_description(rollout) -> list[str]:
    """One line per engine: its ranks and their devices (gathered from every rank; all ranks call)."""
    import torch.distributed as dist

    me = rollout.describe()
    everyone = [me]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
    lines = []
    for k in range(rollout.layout.engines):
        ranks = [d for d in everyone if d["engine"] == k]
        where = ", ".join(f"rank {d['rank']} on {d['device']}" for d in ranks)
        kernels = ranks[0].get("kernels") if ranks else None
        if kernels:  # vLLM on CPU: the kernels it was told to run (tim_megatron/rollout/cpu_kernels.py)
            moe = f", MoE {'/'.join(kernels['moe_experts'])}" if kernels["moe_experts"] else ""
            where += f" (attention {'/'.join(kernels['attention_backends'])}{moe})"
        lines.append(f"  rollout engine {k} of {rollout.layout.engines}: {where}")
    return lines


def _run_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.blake2b(str(run_dir.resolve()).encode(), digest_size=6).hexdigest()


def remedy_info(*, recipe, trainer, rollout) -> dict:
    """Numbers that show, in the first logged step, which precision remedies are really in force."""
    import torch

    from tim_megatron.trainer.logprobs import head_gemm, head_weight

    w = head_weight(trainer.model)
    with torch.no_grad():  # the dtype the trainer's head GEMM really computes in
        head_fp32 = (
            head_gemm(torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device), w, trainer.head).dtype
            == torch.float32
            and trainer.head.fp32
        )
    return {
        "remedy/trainer_fp16": float(trainer.dtype == "float16"),
        "remedy/trainer_head_fp32": float(head_fp32),
        "remedy/router_replay_hooks": float(trainer.replay_enabled),
        "remedy/rollout_head_fp32": float(rollout.head_dtype() == "torch.float32"),
        "remedy/rollout_fp16": float(recipe.rollout_dtype == "float16"),
        "kernels/grouped_experts": float(trainer.kernels.experts == "grouped"),
        "kernels/fused_attention": float(trainer.kernels.attention == "sdpa"),
    }
