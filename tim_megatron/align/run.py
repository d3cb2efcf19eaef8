"""``tim align``: build this rank's trainer and vLLM engine from the recipe (the recipe's dtypes and layout),
choose the token sequences, record both sides on them, compare, and write the report on rank 0."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tim_megatron.align.capture import Capture, decoder_layers, engine_capture, hf_capture, trainer_capture
from tim_megatron.align.compare import Alignment, compare
from tim_megatron.align.floor import measure_floor, tolerance_of
from tim_megatron.modes import modes_of
from tim_megatron.recipe import LoadedRecipe
from tim_megatron.untrusted import recorded


@dataclass(frozen=True)
class AlignOptions:
    """What ``tim align`` was asked for besides the recipe."""

    tokens: Path | None = None
    """A JSON file with a list of token-id lists to compare on; None: sample them with the engine."""
    prompts: int = 8
    """How many of step 1's prompts the engine samples one response for (when no ``tokens`` file is given)."""
    tolerance: float | None = 1e-5
    """The judged difference above which a component counts as diverged; None: 1e-5 when every compared side
    computes in float32, else a multiple of the floor measured on this machine (:mod:`~tim_megatron.align.floor`)."""
    fault_layer: int | None = None
    """Scale the engine's (only the engine's) expert weights of this decoder layer by ``1 + fault_scale`` before
    recording: a planted divergence the report must find (to certify the tool on a model)."""
    fault_scale: float = 1e-2
    sides: tuple[str, str] = ("engine", "trainer")
    """The two sides compared, from :data:`SIDES`: the vLLM engine, the Megatron trainer, and the HF transformers
    model loaded in float32 (the reference; loaded whole on every rank, so for models that fit)."""

    def __post_init__(self):
        if self.fault_layer is not None and "engine" not in self.sides:
            raise ValueError(
                f"--fault-layer {self.fault_layer}: the fault is planted in the engine, which --sides "
                f"{','.join(self.sides)} leaves out (allowed: --sides with engine)"
            )


HALF_PRECISION_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2}
"""What ``tim preflight``'s alignment judges when a side computes in half precision (fixed: ``tim align`` itself
measures its floor on the running machine, :mod:`~tim_megatron.align.floor`). Set when the head was judged in raw
nats, from healthy bf16 engines on the tiny families (the head's 1.6e-2 nats, 3.1e-2 for GLM-4.5's); fp16 keeps 3
more mantissa bits. A broken transfer (a rotated or stale tensor) differs by order 1."""


def tolerance_for(recipe) -> float:
    """1e-5 when both sides compute in float32, else the half-precision tolerance of the coarser side."""
    dtypes = {recipe.trainer_dtype, recipe.rollout_dtype}
    if dtypes == {"float32"}:
        return 1e-5
    return max(HALF_PRECISION_TOLERANCE.get(d, 1e-5) for d in dtypes)


SIDES = ("engine", "trainer", "hf")
"""What ``tim align`` can compare, two at a time."""


def parse_sides(text: str) -> tuple[str, str]:
    """``--sides A,B``: two different names of :data:`SIDES`, named in the error otherwise."""
    parts = tuple(p.strip() for p in text.split(","))
    if len(parts) != 2 or parts[0] == parts[1] or not set(parts) <= set(SIDES):
        raise ValueError(
            f"--sides {text}: give two different sides, comma-separated, from {', '.join(SIDES)}"
        )
    return parts


MIN_TOKENS = 5
"""The shortest ``--tokens`` sequence: sequences of 2 to 4 tokens crashed vLLM's CPU attention with SIGILL (exit 132,
no message) on an Intel AMX machine, where vLLM 0.32 takes its ``amx`` attention kernels in bfloat16 (AMX tiles of 16
rows, in compiled code; its Python side, ``vllm/v1/attention/backends/cpu_attn.py``, states no length limit). They
ran on an AMD EPYC (``vec`` kernels, float32 and bfloat16), so the limit here is the shortest length seen to crash,
plus one."""


def check_length(seqs: list[list[int]]) -> None:
    """Every sequence at least :data:`MIN_TOKENS` long, named."""
    for i, s in enumerate(seqs):
        if len(s) < MIN_TOKENS:
            raise ValueError(
                f"--tokens: sequence {i} has {len(s)} tokens; tim align needs at least {MIN_TOKENS} (vLLM's CPU "
                "attention crashes on shorter ones on some CPUs)"
            )


def check_tokens(seqs: list[list[int]], recipe) -> None:
    """Every id inside the vocabulary and every sequence within ``rollout.max_model_len``, named."""
    vocab, longest = recipe.model.dims.vocab_size, recipe.rollout.max_model_len
    for i, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"--tokens: sequence {i} has ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(s) > longest:
            raise ValueError(
                f"--tokens: sequence {i} has {len(s)} tokens; rollout.max_model_len = {longest} allows at most that"
            )


MAX_TOKENS_FILE_BYTES = 64 << 20


def read_tokens(path: Path) -> list[list[int]]:
    """The sequences of a ``--tokens`` file: a JSON list of lists of 2 or more token ids (integers; ``true`` is not
    one), read only when it is a regular file (a FIFO would block the command)."""
    from tim_megatron.safe_files import read_text

    try:
        seqs = json.loads(read_text(path, what="--tokens", max_bytes=MAX_TOKENS_FILE_BYTES))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:  # UnsafePathError is an OSError
        raise ValueError(f"--tokens {path}: not a readable JSON file ({e})") from None
    shape = "expected a JSON list of token-id lists of 2 or more ids each, e.g. [[1, 5, 9, 2, 7], ...]"
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and len(s) >= 2 for s in seqs):
        raise ValueError(f"--tokens {path}: {shape}")
    for i, s in enumerate(seqs):
        for t in s:
            if isinstance(t, bool) or not isinstance(t, int):  # JSON true is Python's True, an int
                raise ValueError(
                    f"--tokens {path}: sequence {i} holds {json.dumps(t)[:40]}, not a token id (an integer); {shape}"
                )
    return seqs


def check_inputs(recipe, options: AlignOptions, out: Path) -> list[list[int]] | None:
    """Everything ``tim align`` is given, checked before any work (no checkpoint built, no trainer or engine
    started): what it cannot compare, the ``--tokens`` sequences (ids, vocabulary, lengths) and the ``--out`` folder
    (created if missing). Returns the sequences (None: the engine samples them). Raises ``ValueError``, named."""
    from tim_megatron.align.report import check_out

    refuse(recipe)
    seqs = None
    if options.tokens is not None:
        seqs = read_tokens(options.tokens)
        check_tokens(seqs, recipe)
        check_length(seqs)
    check_out(out)
    return seqs


def refuse(recipe) -> None:
    """What ``tim align`` cannot compare, named by its key."""
    if (backend := modes_of(recipe).backend) != "vllm":
        raise ValueError(
            f"rollout.backend = {backend}: tim align compares the vLLM engine with the trainer; "
            "the trainer backend samples with the trainer's own forward (allowed: rollout.backend = vllm)"
        )
    if not recipe.rollout.enforce_eager:
        raise ValueError(
            "rollout.enforce_eager = false: tim align records vLLM's layers through hooks, which compiled graphs "
            "skip; add rollout.enforce_eager=true (allowed here: true)"
        )
    if recipe.parallel.pp > 1:
        raise ValueError(
            f"parallel.pp = {recipe.parallel.pp}: tim align records one pipeline stage; allowed pp = 1"
        )


def sampled(engine, prompts, count: int) -> list[list[int]]:
    """One response for each of the first ``count`` prompts of step 1, as prompt + response ids (every rank of an
    engine submits the same requests)."""
    items = prompts.step_items(1, max(count, 1))[:count]
    groups, _ = engine.generate(prompts.encode(items), step=1, first_index=0, n=1)
    return [g[0].prompt_ids + g[0].response_ids for g in groups]


def perturb_engine_experts(engine, trainer, *, layer: int, scale: float) -> int:
    """Load the trainer's weights into the engine only (a whole sync, as the loop does), with the routed experts
    of decoder layer ``layer`` times ``1 + scale``; returns how many tensors were scaled."""
    d = trainer.dims
    if not (d.is_moe and d.first_k_dense_layers <= layer < d.num_layers):
        moe = f"{d.first_k_dense_layers}..{d.num_layers - 1}" if d.is_moe else "none"
        raise ValueError(f"--fault-layer {layer}: not a MoE layer of this model (its MoE layers: {moe})")
    tag, changed = f".layers.{layer}.", 0

    def stream():  # one tensor at a time, as the sync streams them
        nonlocal changed
        for n, t in trainer.export_hf():
            hit = tag in n and ".experts." in n
            changed += hit
            yield n, t * (1 + scale) if hit else t

    engine.update_weights(stream())
    engine.reset_prefix_cache()
    if not changed:
        raise RuntimeError(
            f"--fault-layer {layer}: the export carried no routed-expert tensor of layer {layer}"
        )
    return changed


def replay_of(engine_cap: Capture) -> list[torch.Tensor]:
    """Per sequence, the engine's experts ``[moe_layers, len, k]``: what the trainer replays under R3."""
    moe = [i for i in range(engine_cap.num_layers) if engine_cap.get("topk", i) is not None]
    out, start = [], 0
    for n in engine_cap.lengths:
        out.append(torch.stack([engine_cap.get("topk", i)[start : start + n] for i in moe]))
        start += n
    return out


def compare_sides(engine, trainer, seqs, options: AlignOptions, *, replay: bool, hf=None) -> Alignment:
    """The comparison of ``options.sides`` asked for, with the ones that make it readable beside it (in
    ``others``): before the planted fault (the same sides without it), and without replay (the trainer routing
    itself) when R3 is on. Under R3 the trainer replays the other side's experts (the engine's, or HF's)."""
    if options.tolerance is None:
        raise ValueError("compare_sides: give a tolerance (align() measures one when none is given)")
    first, second = options.sides
    layers = len(decoder_layers(trainer))

    def record(side: str) -> Capture:
        if side == "engine":
            return engine_capture(engine, seqs, num_layers=layers)
        if side == "hf":
            return hf_capture(hf, seqs, dims=trainer.dims)
        return trainer_capture(trainer, seqs)  # the trainer routing with its own router

    before = None
    if options.fault_layer is not None:
        before = compare(record(first), record(second), tolerance=options.tolerance)
        perturb_engine_experts(engine, trainer, layer=options.fault_layer, scale=options.fault_scale)
    caps = {side: record(side) for side in options.sides}
    r3 = replay and trainer.replay_enabled and "trainer" in options.sides
    own = caps.get("trainer")
    if r3:
        other = second if first == "trainer" else first
        caps["trainer"] = trainer_capture(trainer, seqs, replay=replay_of(caps[other]))
    result = compare(caps[first], caps[second], tolerance=options.tolerance, skip_last=r3)
    if before is not None:
        result.others["before_fault"] = before.as_dict()
        result.notes.append(
            f"planted fault: the engine's experts of layer {options.fault_layer} scaled by {1 + options.fault_scale:g}"
        )
    if r3:
        unreplayed = {**caps, "trainer": own}
        without = compare(unreplayed[first], unreplayed[second], tolerance=options.tolerance, skip_last=True)
        result.others["without_replay"] = without.as_dict()
        result.notes.append(
            f"R3: the trainer routed with the {other}'s experts; each sequence's last token (routed to a placeholder "
            "set under replay, its output feeding no logprob) is left out"
        )
    return result


def align(loaded: LoadedRecipe, options: AlignOptions, *, out: Path, console=None) -> Alignment:
    """Check the inputs (:func:`check_inputs`), record both sides on the same sequences and compare them, judged
    with ``options.tolerance`` or, when that is None, the tolerance :func:`~tim_megatron.align.floor.tolerance_of`
    finds; rank 0 writes ``out``."""
    from transformers import AutoTokenizer

    from tim_megatron.align.report import text, write
    from tim_megatron.data.sources import PromptSource
    from tim_megatron.run_setup import build_rollout, model_path_for
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    r = loaded.recipe
    seqs = check_inputs(r, options, out)
    path = model_path_for(r)
    prompts = PromptSource(r.data, seed=r.run.seed, tokenizer=AutoTokenizer.from_pretrained(path))
    trainer = MegatronTrainer.of_run(r, model_path=path)
    engine = build_rollout(r, trainer, model_path=path, tokenizer=prompts.tokenizer)
    if seqs is None:
        seqs = sampled(engine, prompts, options.prompts)
    tolerance = tolerance_of(
        r,
        options.sides,
        given=options.tolerance,
        measure=lambda dtype: measure_floor(path, seqs, dims=trainer.dims, dtype=dtype),
    )
    hf = None
    if "hf" in options.sides:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result = compare_sides(
        engine,
        trainer,
        seqs,
        replace(options, tolerance=tolerance.value),
        replay=modes_of(r).routing.engine_routes,
        hf=hf,
    )
    result.tolerance_from = tolerance.as_dict()
    if trainer.is_rank0:
        meta = {
            "recipe": loaded.name,
            "sides": list(options.sides),
            "trainer_dtype": r.trainer_dtype,
            "rollout_dtype": r.rollout_dtype,
            "fp32_lm_head": r.remedies.fp32_lm_head,
            "router_replay": trainer.modes.routing.replay,
            "rollout_tp": r.rollout.tensor_parallel_size,
            "trainer_layout": {"tp": r.parallel.tp, "ep": r.parallel.ep, "world": trainer.env.world_size},
        }
        write(result, out, sequences=len(seqs), meta=meta)
        if console is not None:
            console.print(recorded(text(result, sequences=len(seqs)), 100_000, lines=True), highlight=False)
    engine.close()
    trainer.close()
    return result
