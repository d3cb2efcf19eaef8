"""Everything a run needs before its first step: model, trainer, rollout engine, data, logging, resume."""

from __future__ import annotations

from pathlib import Path

from tim_megatron.recipe import LoadedRecipe


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
    """This rank's rollout engine: its share of the vLLM fleet, or of the exact sampler (``vexact: exact``)."""
    from tim_megatron.rollout.base import FleetLayout
    from tim_megatron.rollout.engine import VLLMEngine
    from tim_megatron.rollout.exact_sampler import ExactSampler

    if recipe.diagnostics.vexact == "exact":
        return ExactSampler(trainer, eos_id=tokenizer.eos_token_id)
    layout = FleetLayout(world=trainer.env.world_size, ranks_per_engine=recipe.rollout.tensor_parallel_size)
    return VLLMEngine(
        recipe,
        model_path=model_path,
        layout=layout,
        rank=trainer.rank,
        num_moe_layers=trainer.num_moe_layers(),
    )


def setup(
    loaded: LoadedRecipe,
    run_dir: Path,
    *,
    resume: bool,
    console=None,
    trust_unverified: bool = False,
    stop=None,
):
    """``stop``: the installed :class:`tim_megatron.stop.StopRequest` of ``tim train`` (a signal during
    start-up stops it at once); without one, a signal waits for the end of the first step."""
    import torch
    from transformers import AutoTokenizer

    from patches.megatron import checkpoint_writer_signals
    from tim_megatron.data.sources import PromptSource, encode_prompt
    from tim_megatron.logging.tracker import Tracker, truncate_jsonl
    from tim_megatron.rl.colocation import Colocation
    from tim_megatron.rollout.engine import check_model_for_engine
    from tim_megatron.rollout.sync import WeightSync, manifest
    from tim_megatron.run_dir import mark_running
    from tim_megatron.run_state import Run, new_schedule, new_warnings
    from tim_megatron.stop import StopRequest
    from tim_megatron.trainer.checkpoint import latest_good_checkpoint, load_checkpoint, refuse_unsafe
    from tim_megatron.trainer.engine import MegatronTrainer

    r = loaded.recipe
    if stop is None:
        stop = StopRequest()
        stop.install()
    path = model_path_for(r)
    check_model_for_engine(path, on_gpu=torch.cuda.is_available())  # weights present, head size servable
    tokenizer = AutoTokenizer.from_pretrained(path)
    # bad data (and a prompt too long in this tokenizer) fails here, before any engine starts
    source = PromptSource(r.data, seed=r.run.seed, tokenizer=tokenizer)
    trainer = MegatronTrainer(r, model_path=path)
    ckpt = (  # corrupt ones skipped (the ranks share the hashing); checked, with its safety, before vLLM starts
        latest_good_checkpoint(run_dir / "checkpoints", trust_unverified=trust_unverified) if resume else None
    )
    if ckpt is not None:
        refuse_unsafe(ckpt)
    checkpoint_writer_signals.shield()  # a job's SIGTERM must not kill megatron's writer helper
    rollout = build_rollout(r, trainer, model_path=path, tokenizer=tokenizer)
    fault = r.diagnostics.sync_fault
    if fault.kind != "off" and fault.engine >= rollout.layout.engines:
        raise ValueError(
            f"diagnostics.sync_fault.engine = {fault.engine}: this job has rollout engines "
            f"0..{rollout.layout.engines - 1}"
        )
    sync = WeightSync(r, expected=manifest(path), rank=trainer.rank)
    schedule, warnings = new_schedule(r), new_warnings(r)
    start = 1
    if ckpt is not None:
        meta = load_checkpoint(trainer, ckpt)
        schedule.load_state_dict(meta["state"]["schedule"])
        warnings.load_state_dict(meta["state"]["warnings"])
        start = meta["step"] + 1
        if trainer.is_rank0:
            truncate_jsonl(run_dir / "metrics.jsonl", after_step=meta["step"])
    items = source.step_items(1, r.data.prompts_per_step)
    block = rollout.layout.block(len(items), rollout.engine_index)
    probe = [encode_prompt(tokenizer, items[i].prompt) for i in block][:8]
    run = Run(
        loaded=loaded,
        run_dir=run_dir,
        trainer=trainer,
        rollout=rollout,
        sync=sync,
        colocation=Colocation(
            rollout=rollout, trainer=trainer, sync=sync, offload=r.trainer.offload_during_rollout
        ),
        source=source,
        tokenizer=tokenizer,
        schedule=schedule,
        warnings=warnings,
        tracker=None,
        stop=stop,
        capture_agreement=r.capture_routed_experts and trainer.dims.is_moe,
        start_step=start,
    )
    run.probe = probe
    layout = fleet_description(rollout)
    run.info = {**remedy_info(run), "rollout/engines": float(rollout.layout.engines)}
    # a resumed run's engines start from the checkpoint on disk: they get the resumed weights
    run.colocation.start(probe=lambda: probe, resumed=ckpt is not None)
    run.tracker = Tracker(
        r,
        run_dir=run_dir,
        name=f"{loaded.name}/{run_dir.name}",
        run_id=_run_id(run_dir),
        enabled=trainer.is_rank0,
        console=console if trainer.is_rank0 else None,
    )
    if trainer.is_rank0:
        mark_running(run_dir, start_step=start, resumed_from=str(ckpt) if ckpt else None)
        if console is not None:
            console.print(
                f"[bold]tim train[/] {loaded.name}: steps {start}..{r.run.steps} in {run_dir}"
                f" (trainer {trainer.dtype}, rollout {r.rollout_dtype}, world {trainer.env.world_size})",
                highlight=False,
            )
            for line in layout:
                console.print(line, highlight=False)
    return run


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
        lines.append(f"  rollout engine {k} of {rollout.layout.engines}: {where}")
    return lines


def _run_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.blake2b(str(run_dir.resolve()).encode(), digest_size=6).hexdigest()


def remedy_info(run) -> dict:
    """Numbers that show, in the first logged step, which precision remedies are really in force."""
    import torch

    from tim_megatron.trainer.logprobs import head_weight

    tr = run.trainer
    w = head_weight(tr.model)
    with torch.no_grad():  # the dtype the trainer's head really produces logits in
        from tim_megatron.trainer.logprobs import _logits

        head_fp32 = (
            _logits(torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device), w, tr.head).dtype
            == torch.float32
            and tr.head.fp32
        )
    info = {
        "remedy/trainer_fp16": float(tr.dtype == "float16"),
        "remedy/trainer_head_fp32": float(head_fp32),
        "remedy/router_replay_hooks": float(tr.replay_enabled),
    }
    info["remedy/rollout_head_fp32"] = float(run.rollout.head_dtype() == "torch.float32")
    info["remedy/rollout_fp16"] = float(run.recipe.rollout_dtype == "float16")
    return info
