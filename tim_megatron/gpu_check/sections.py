"""The parts of ``make gpu-check``. Each section takes the :class:`Bench` (device, work folder, checkpoints)
and returns its findings; it builds its own trainers and frees them before it returns."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tim_megatron.gpu_check import compare
from tim_megatron.gpu_check.models import (
    hf_logprobs,
    hf_router_topk,
    next_token_mask,
    probe_batch,
    qwen3_moe_1b_dims,
    random_checkpoint,
    recipe_for,
)
from tim_megatron.gpu_check.report import finding
from tim_megatron.outcome import Outcome
from tim_megatron.recipe.schema import ModelDims
from tim_megatron.slurm.plan import param_count


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    """The HF checkpoint folder."""
    recipe_path: str
    """What ``model.path`` says: ``tiny`` for the built-in model, else the folder."""
    dims: ModelDims


@dataclass
class Bench:
    """What every section shares: where it runs and the checkpoints built so far."""

    device: str
    """``cuda`` or ``cpu``."""
    workdir: Path
    gpu_type: str | None = None
    """``tim plan``'s name for this GPU, when it knows it."""
    _models: dict[str, Model] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def tiny(self) -> Model:
        if "tiny" not in self._models:
            from tim_megatron.run_setup import model_path_for

            r = recipe_for("tiny", None, dtype="float32", micro_batch=1, max_model_len=32, gpus=0)
            self._models["tiny"] = Model("tiny MoE", model_path_for(r), "tiny", r.model.dims)
        return self._models["tiny"]

    def one_b(self) -> Model:
        if "1b" not in self._models:
            dims = qwen3_moe_1b_dims()
            path = random_checkpoint(dims, self.workdir / "qwen3-moe-1b-random", device=self.device)
            self._models["1b"] = Model("Qwen3-MoE ~1B (random)", path, str(path), dims)
        return self._models["1b"]

    def recipe(
        self,
        model: Model,
        *,
        dtype: str,
        micro_batch: int,
        max_model_len: int,
        overrides: tuple[str, ...] = (),
    ):
        return recipe_for(
            model.recipe_path,
            model.dims,
            dtype=dtype,
            micro_batch=micro_batch,
            max_model_len=max_model_len,
            gpus=1 if self.on_gpu else 0,
            gpu_type=self.gpu_type,
            overrides=overrides,
        )

    def trainer(self, model: Model, **recipe_kw):
        from tim_megatron.trainer.megatron_trainer import MegatronTrainer

        return MegatronTrainer.of_run(self.recipe(model, **recipe_kw), model_path=model.path)

    def with_trainer(self, model: Model, use, **recipe_kw):
        """``use(trainer)`` on a fresh trainer for ``recipe_kw``; the trainer is closed, dropped and its memory
        freed afterwards, whether ``use`` returns or raises."""
        tr = self.trainer(model, **recipe_kw)
        try:
            return use(tr)
        finally:
            tr.close()
            del tr
            self.free()

    def free(self) -> None:
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()


def model_finding(model: Model, section: str) -> Outcome:
    """The first line of every section: which model, and its size."""
    return finding(section, f"model: {model.name}", param_count(model.dims).total / 1e9, "B params", "info")


# ------------------------------------------------------------------------------------------- parity


def parity(bench: Bench, model: Model, *, section: str, n: int, length: int) -> list[Outcome]:
    """Megatron's per-token logprobs in fp32 and bf16 against HF transformers in fp32, same weights, same tokens."""
    from tim_megatron.trainer.megatron_trainer import SeqBatch

    ids, lengths = probe_batch(vocab=model.dims.vocab_size, n=n, length=length)
    mask = next_token_mask(lengths, length)
    ref = hf_logprobs(model.path, ids, dtype=torch.float32, device=bench.device)
    hf_bf16 = hf_logprobs(model.path, ids, dtype=torch.bfloat16, device=bench.device)
    yardstick = compare.logprob_gap(got=hf_bf16, want=ref, mask=mask)
    out = [
        model_finding(model, section),
        finding(
            section,
            f"HF bf16 vs HF fp32, mean |dlogp| over {yardstick.tokens} tokens (the yardstick)",
            yardstick.mean,
            "nats",
            "info",
        ),
    ]
    for dtype in ("float32", "bfloat16"):
        got = bench.with_trainer(
            model,
            lambda tr: tr.logprobs(SeqBatch(ids, lengths))[0].logprobs[:, 1:],
            dtype=dtype,
            micro_batch=n,
            max_model_len=length,
        )
        gap = compare.logprob_gap(got=got, want=ref, mask=mask)
        if dtype == "float32":
            status, rule = compare.judge_fp32(gap)
            out.append(
                finding(section, "megatron fp32 vs HF fp32, max |dlogp|", gap.max, "nats", status, rule)
            )
            out.append(finding(section, "megatron fp32 vs HF fp32, mean |dlogp|", gap.mean, "nats", "info"))
        else:
            status, rule = compare.judge_bf16(gap, yardstick=yardstick)
            out.append(
                finding(section, "megatron bf16 vs HF fp32, mean |dlogp|", gap.mean, "nats", status, rule)
            )
            out.append(finding(section, "megatron bf16 vs HF fp32, p99 |dlogp|", gap.p99, "nats", "info"))
            out.append(finding(section, "megatron bf16 vs HF fp32, max |dlogp|", gap.max, "nats", "info"))
    return out


# ---------------------------------------------------------------------------------------- train step


@dataclass(frozen=True)
class StepParts:
    """What :func:`train_step` measured with, for more measurements on the same trainer (its ``also``)."""

    trainer: object
    batch: object
    """The trainer's batch (a ``SeqBatch``)."""
    loss_fn: Callable
    """The RL loss of the batch, as the loop hands it to ``trainer.train_step``."""
    bare: Callable[[], None]
    """One bare megatron-core step on the same tokens (:func:`~tim_megatron.bench.bare.bare_megatron_step`)."""
    ids: torch.Tensor
    mask: torch.Tensor

    def ours(self, loss_fn: Callable | None = None) -> None:
        """One of our train steps (with ``loss_fn`` in place of the batch's own)."""
        self.trainer.train_step(self.batch, loss_fn or self.loss_fn, lr=1e-6)


def _loss_fn(recipe, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor):
    """The RL loop's own loss (the recipe's objective, :func:`tim_megatron.rl.objective.make_loss_fn`) over
    host tensors, as the loop hands it to the trainer; the rollout logprobs are the old ones."""
    from tim_megatron.rl.objective import LossRows, make_loss_fn

    loss_rows = LossRows(old=old, rollout=old, mask=mask, advantages=adv, weights=mask.float())
    return make_loss_fn(recipe, loss_rows, denominator=float(mask.sum()))


def _random_batch(model: Model, *, seqs: int, length: int, seed: int, prompt: int):
    """Random full-length sequences: ids, the trainer's batch, the loss mask (the first ``prompt`` positions
    off) and one advantage per sequence."""
    from tim_megatron.trainer.megatron_trainer import SeqBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.dims.vocab_size, (seqs, length), generator=g)
    mask = torch.ones(seqs, length, dtype=torch.bool)
    mask[:, :prompt] = False
    return ids, SeqBatch(ids, torch.full((seqs,), length)), mask, torch.randn(seqs, generator=g)


def train_step(
    bench: Bench,
    model: Model,
    *,
    section: str,
    seqs: int,
    length: int,
    repeat: int,
    overrides: tuple[str, ...] = (),
    also: Callable[[StepParts], list[Outcome]] | None = None,
) -> list[Outcome]:
    """Our train step vs a bare megatron-core step (same model, batch, process), and on CUDA its peak
    memory against ``tim plan``'s estimate for the same recipe (``overrides``: recipe settings, last). ``also``: more
    measurements on the same trainer and batch (the ``moe layer`` profile), before the trainer is closed."""
    from tim_megatron.bench.bare import bare_megatron_step
    from tim_megatron.slurm.plan import GIB, estimate

    recipe = bench.recipe(
        model, dtype="bfloat16", micro_batch=seqs, max_model_len=length, overrides=overrides
    )
    bench.free()
    if bench.on_gpu:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer.of_run(recipe, model_path=model.path)
    k = tr.kernels
    out = [
        model_finding(model, section),
        finding(section, f"kernels: attention {k.attention}, experts {k.experts}"),
    ]
    try:
        ids, batch, mask, adv = _random_batch(model, seqs=seqs, length=length, seed=0, prompt=length // 4)
        old = tr.logprobs(batch)[0].logprobs
        loss_fn = _loss_fn(recipe, old, mask, adv)

        parts: list[dict[str, float]] = []

        def ours():
            parts.append(tr.train_step(batch, loss_fn, lr=1e-6).times)

        if bench.on_gpu:  # the first step allocates the optimizer state: the step's true peak
            ours()
            peak = torch.cuda.max_memory_allocated() - base
            from tim_megatron.trainer.model import te_available

            local = not te_available() and tr.kernels.attention == "materialized"
            planned = estimate(
                recipe, materialized_attention=local, grouped_experts=tr.kernels.experts == "grouped"
            ).trainer
            ratio, status, rule = compare.judge_memory(peak, planned)
            if local:
                rule += "; materialized attention: the plan counts its scores"
            out += [
                finding(
                    section, "peak allocated: trainer build + first train step", peak / GIB, "GiB", "info"
                ),
                finding(
                    section,
                    "peak reserved by the caching allocator",
                    torch.cuda.max_memory_reserved() / GIB,
                    "GiB",
                    "info",
                ),
                finding(
                    section,
                    "tim plan: parameters + gradients + optimizer + activations",
                    planned / GIB,
                    "GiB",
                    "info",
                ),
                finding(section, "peak / plan", ratio, "x", status, rule),
            ]

        bare = bare_megatron_step(tr, ids=ids, mask=mask)

        def timed(fn) -> float:
            bench.sync()
            t = time.perf_counter()
            fn()
            bench.sync()
            return time.perf_counter() - t

        ours(), bare()  # warm-up
        t_ours, t_bare = [], []
        for _ in range(repeat):  # interleaved, so drift hits both alike
            t_ours.append(timed(ours))
            t_bare.append(timed(bare))
        to, tb = statistics.median(t_ours), statistics.median(t_bare)
        ratio, status, rule = compare.judge_step_ratio(to, tb)
        if not bench.on_gpu:  # CPU timings here are disturbed by whatever else runs; make bench measures them
            status, rule = "info", "not judged on CPU"
        out += [
            finding(section, f"our train step, {seqs} x {length} tokens, bf16 (median)", to, "s", "info"),
            finding(section, "bare megatron-core fwd + bwd + optimizer step (median)", tb, "s", "info"),
            finding(section, "ours / bare", ratio, "x", status, rule),
        ]
        for key, what in (("fwd_bwd", "forward + backward"), ("optimizer", "finite check + optimizer step")):
            got = [p[key] for p in parts[-repeat:] if key in p]
            if got:  # host-side clocks around each phase (the phases end in a host sync of their own)
                out.append(finding(section, f"  ours: {what} (median)", statistics.median(got), "s", "info"))
        if also is not None:
            out += also(StepParts(trainer=tr, batch=batch, loss_fn=loss_fn, bare=bare, ids=ids, mask=mask))
    finally:
        tr.close()  # its memory goes when this frame does; run_sections then frees the cache
    return out


# --------------------------------------------------------------------------------------------- offload


def _state_snapshot(trainer) -> list[torch.Tensor]:
    """A copy, on the same device, of every storage the offload moves (parameters, gradient buffers, optimizer
    state), as bytes, in a fixed order."""
    from tim_megatron.trainer.offload import storage_bytes, trainer_tensors

    parts = trainer.host.storages(trainer_tensors(trainer.model, trainer.optimizer)).values()
    return [storage_bytes(s).clone() for storages in parts for s in storages.values()]


def offload_round_trip(bench: Bench, model: Model, *, section: str, seqs: int, length: int) -> list[Outcome]:
    """``trainer.offload_during_rollout: all`` once: after a train step (so Adam's state exists), the whole state
    goes to host memory and back. Bytes, seconds, device memory freed, the state's bytes before and after, the
    logprobs before and after, and a train step after it."""
    from tim_megatron.slurm.plan import GIB
    from tim_megatron.trainer.offload import LEVELS

    tr = bench.trainer(model, dtype="bfloat16", micro_batch=seqs, max_model_len=length)
    out = [model_finding(model, section)]
    try:
        _, batch, mask, adv = _random_batch(model, seqs=seqs, length=length, seed=3, prompt=0)
        old = tr.logprobs(batch)[0].logprobs
        tr.train_step(batch, _loss_fn(tr.recipe, old, mask, adv), lr=1e-6)
        before = tr.logprobs(batch)[0].logprobs
        snapshot = _state_snapshot(tr)
        bench.free()
        used = torch.cuda.memory_allocated() if bench.on_gpu else 0
        away = tr.offload(LEVELS["all"])
        freed = used - torch.cuda.memory_allocated() if bench.on_gpu else 0
        back = tr.onload()
        again_away, again_back = tr.offload(LEVELS["all"]), tr.onload()  # host buffers reused, as every step
        now = _state_snapshot(tr)
        same_state = len(now) == len(snapshot) and all(map(torch.equal, now, snapshot))
        del snapshot, now
        after = tr.logprobs(batch)[0].logprobs
        d = float((after - before).abs().max())
        loss = tr.train_step(batch, _loss_fn(tr.recipe, before, mask, adv), lr=1e-6).loss
        total = away.total_bytes
        exact, exact_rule = compare.judge_exact(d)
        out += [
            finding(section, "state moved (params + grads + optimizer)", total / GIB, "GiB", "info"),
            *(finding(section, f"  of which {p}", n / GIB, "GiB", "info") for p, n in away.bytes.items()),
        ]
        for when, out_, in_ in (("first", away, back), ("again", again_away, again_back)):
            for what, m in (("offload", out_), ("onload", in_)):
                rate = m.total_bytes / m.seconds / 1e9 if m.seconds else None
                first = when == "first" and what == "offload"
                why = "includes allocating the pinned host buffers, which later moves reuse" if first else ""
                out.append(finding(section, f"{what} ({when}): seconds", m.seconds, "s", "info", why))
                out.append(finding(section, f"{what} ({when}): GB/s", rate, "GB/s", "info"))
        if bench.on_gpu:
            out.append(
                finding(
                    section,
                    "device memory freed by the offload",
                    freed / GIB,
                    "GiB",
                    "ok" if freed >= 0.9 * total else "fail",
                    ">= 90% of the bytes moved",
                )
            )
        out += [
            finding(
                section,
                "state bytes after the round trips equal before",
                float(same_state),
                "",
                "ok" if same_state else "fail",
                "every moved storage, byte for byte",
            ),
            finding(section, "logprobs after vs before, max |dlogp|", d, "nats", exact, exact_rule),
            finding(
                section,
                "a train step after the round trip: loss",
                loss,
                "",
                "ok" if loss == loss and abs(loss) != float("inf") else "fail",
                "finite",
            ),
        ]
    finally:
        tr.close()
    return out


# ------------------------------------------------------------------------------------- exact kernels


def exact_kernels(bench: Bench, *, section: str) -> list[Outcome]:
    """Do exact mode's tiled kernels give a row the same bits alone as among many on this device (GEMMs at decode
    shapes, attention's bmm, softmax, the activations, the head's reduction; float32 and bfloat16)? torch's own ops
    are the contrast."""
    import contextlib

    from tim_megatron.exact.kernels import cuda_reductions_pinned

    # on a GPU, what kernels_for sets before it checks, for this section only
    with cuda_reductions_pinned() if bench.on_gpu else contextlib.nullcontext():
        return _exact_cases(bench, section=section)


def _exact_cases(bench: Bench, *, section: str) -> list[Outcome]:
    from tim_megatron.exact.kernels import (
        PlainKernels,
        candidates_for,
        invariance_checks,
        invariance_problems,
    )

    out = []
    candidates = candidates_for(bench.device)
    admitted = None
    contrast = () if any(k.name in ("plain", "cuda-native") for k in candidates) else (PlainKernels(),)
    for kernels in (*candidates, *contrast):
        t = time.perf_counter()
        problems = invariance_problems(kernels, device=bench.device)
        if admitted is None and not problems and kernels in candidates:
            admitted = kernels.name
        bench.sync()
        out.append(
            finding(
                section,
                f"{kernels.name} kernels: cases where a row's bits depend on the batch "
                f"(of {invariance_checks(bench.device)})",
                len(problems),
                "",
                "info",
                "; ".join(problems) if problems else "row-invariant at every shape tried",
            )
        )
        out.append(
            finding(section, f"{kernels.name} kernels: check time", time.perf_counter() - t, "s", "info")
        )
    order = ", ".join(k.name for k in candidates)
    out.append(
        finding(
            section,
            f"admitted for exact runs: {admitted or 'none'} (candidates, fastest first: {order})",
            None,
            "",
            "info",
            "the first candidate with no failing case (tim_megatron/exact/kernels.py admit_kernels)",
        )
    )
    return out


EXACT_RUN = "recipes/tiny-moe/vexact.yaml"
EXACT_TOPK = 8
"""Every token through 8 experts (the tiny model has 8): a combine of 3 or more outputs is where adding them in
another order shows; at the recipe's top-2, any order gives the same bits."""


def exact_run(bench: Bench, *, section: str, steps: int = 5) -> list[Outcome]:
    """``tim train recipes/tiny-moe/vexact.yaml`` at top-8 for ``steps`` steps on this device (the trainer samples; every
    sampled token's logprob must equal the old pass's bit for bit, checked each step). On failure the note names
    what broke: the case ``kernels_for`` found on the device, or the first token that differed."""
    import subprocess
    import sys

    from tim_megatron.bench.exact import QUIET
    from tim_megatron.logging.tracker import read_metrics

    root = Path(__file__).resolve().parents[2]
    out_dir = bench.workdir / "exact-run"
    cmd = [sys.executable, "-m", "tim_megatron.cli", "train", EXACT_RUN, f"run.steps={steps}"]
    cmd += [f"model.dims.num_experts_per_tok={EXACT_TOPK}"]
    cmd += [f"run.output_dir={out_dir}", *QUIET, "checkpoint.at_end=false"]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=480)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, stderr = -1, f"{(e.stderr or b'')[-200:]!r}\nError: the exact run did not end in 480 s"
    seconds = time.perf_counter() - t
    rows = [row for path in sorted(out_dir.rglob("metrics.jsonl")) for row in read_metrics(path)]
    exact = [
        r for r in rows if r.get("exact/mismatched_tokens") == 0.0 and r.get("exact/checked_tokens", 0) > 0
    ]
    ok = returncode == 0 and len(exact) == steps
    why = ""
    if not ok:
        lines = [ln for ln in stderr.splitlines() if "Error" in ln or "exact mode" in ln]
        why = (lines[-1] if lines else stderr.strip()[-300:]).strip()
    return [
        finding(
            section,
            f"exact run on {bench.device}, top-{EXACT_TOPK}: steps with every token exact (of {steps})",
            float(len(exact)),
            "",
            "ok" if ok else "fail",
            f"{sum(r['exact/checked_tokens'] for r in exact):.0f} tokens checked" if ok else why[:300],
        ),
        finding(section, "exact run: wall time", seconds, "s", "info"),
    ]


# ---------------------------------------------------------------------------------------- checkpoint


def checkpoint_round_trip(bench: Bench, model: Model, *, section: str) -> list[Outcome]:
    """Train a step, save, train another; a fresh trainer loads the save and must reproduce both exactly."""
    from tim_megatron.trainer.checkpoint import load_checkpoint, save_checkpoint
    from tim_megatron.trainer.megatron_trainer import SeqBatch

    ids, lengths = probe_batch(vocab=model.dims.vocab_size, n=8, length=32, seed=1)
    batch = SeqBatch(ids, lengths)
    mask = next_token_mask(lengths, 32)
    mask = torch.nn.functional.pad(mask, (1, 0))
    adv = torch.linspace(-1, 1, 8)
    kw = dict(dtype="bfloat16", micro_batch=8, max_model_len=32)

    def step(tr) -> float:
        old = tr.logprobs(batch)[0].logprobs
        return tr.train_step(batch, _loss_fn(tr.recipe, old, mask, adv), lr=1e-3).loss

    def save_between_steps(tr):
        step(tr)
        saved = save_checkpoint(tr, bench.workdir / "checkpoints", step=1, state={"gpu_check": True})
        before = tr.logprobs(batch)[0].logprobs
        step(tr)
        return saved, before, tr.logprobs(batch)[0].logprobs

    def restore_and_step(tr):
        load_checkpoint(tr, saved)
        restored = tr.logprobs(batch)[0].logprobs
        step(tr)
        return restored, tr.logprobs(batch)[0].logprobs

    saved, before, after = bench.with_trainer(model, save_between_steps, **kw)
    restored, resumed = bench.with_trainer(model, restore_and_step, **kw)
    d_restore = float((restored - before).abs().max())
    d_next = float((resumed - after).abs().max())
    status, rule = compare.judge_exact(d_restore)
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    return [
        model_finding(model, section),
        finding(section, "checkpoint size", size / 2**30, "GiB", "info"),
        finding(section, "restored vs saved model, max |dlogp|", d_restore, "nats", status, rule),
        finding(section, "one more step after restore vs without, max |dlogp|", d_next, "nats", "info"),
    ]


# --------------------------------------------------------------------------------------------- vLLM


def _start_vllm(bench: Bench, model: Model, *, max_model_len: int, native_capture: bool):
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: faster, and nothing spawns
    from vllm import LLM

    kwargs = dict(
        model=str(model.path),
        dtype="bfloat16",
        max_model_len=max_model_len,
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.2,  # on CPU: the share of host memory it may reserve
    )
    if bench.on_gpu:
        kwargs["enable_sleep_mode"] = True
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if native_capture:
        kwargs["enable_return_routed_experts"] = True
    return LLM(**kwargs)


def _vllm_logprobs(llm, seqs: list[list[int]], length: int) -> torch.Tensor:
    """vLLM's logprob of each next token (prompt logprobs), ``[n, length - 1]``, zero beyond each sequence."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=None)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    got = torch.zeros(len(seqs), length - 1)
    for i, (s, o) in enumerate(zip(seqs, outs, strict=True)):
        for t, d in enumerate(o.prompt_logprobs[1:], start=1):
            got[i, t - 1] = d[s[t]].logprob
    return got


def _native_capture(bench: Bench, model: Model, llm, seqs: list[list[int]], *, section: str) -> Outcome:
    """Greedy continuations with ``return_routed_experts``: shape, id range, and agreement with HF's router."""
    import numpy as np
    from vllm import SamplingParams

    prompts = [s[:8] for s in seqs[:4]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, return_routed_experts=True)
    gens = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    d = model.dims
    agree, bad = [], []
    for p, o in zip(prompts, gens, strict=True):
        c = o.outputs[0]
        full = p + list(c.token_ids)
        got = torch.as_tensor(np.asarray(c.routed_experts)).long()
        shape = (len(full) - 1, d.num_layers, d.num_experts_per_tok)
        if tuple(got.shape) != shape or int(got.min()) < 0 or int(got.max()) >= d.num_experts:
            bad.append(f"shape {tuple(got.shape)} (want {shape}), ids {int(got.min())}..{int(got.max())}")
            continue
        want = hf_router_topk(model.path, torch.tensor([full]), k=d.num_experts_per_tok, device=bench.device)
        agree.append(compare.topk_agreement(got=got, want=want[0, : len(full) - 1]))
    share = statistics.mean(agree) if agree else 0.0
    ok = not bad and share >= compare.ROUTING_AGREEMENT_MIN
    rule = f"[tokens, layers, k] per response, agreement >= {compare.ROUTING_AGREEMENT_MIN:g}"
    return finding(
        section,
        "native capture: top-k sets equal to HF fp32 router's",
        share,
        "",
        "ok" if ok else "fail",
        rule + (f"; {'; '.join(bad)}" if bad else ""),
    )


def vllm_engine(bench: Bench, model: Model, *, section: str) -> list[Outcome]:
    """vLLM in bf16: logprob parity with HF fp32, sleep/wake (memory freed on CUDA, logprobs unchanged after
    wake-up), and native routed-expert capture (CUDA only: it needs Model Runner V2, hence Triton)."""
    import inspect

    from vllm import SamplingParams

    n, length = 8, 32
    ids, lengths = probe_batch(vocab=model.dims.vocab_size, n=n, length=length, seed=2)
    mask = next_token_mask(lengths, length)
    seqs = [ids[i, : int(lengths[i])].tolist() for i in range(n)]
    ref = hf_logprobs(model.path, ids, dtype=torch.float32, device=bench.device)
    hf_bf16 = hf_logprobs(model.path, ids, dtype=torch.bfloat16, device=bench.device)
    yardstick = compare.logprob_gap(got=hf_bf16, want=ref, mask=mask)
    native = bench.on_gpu and "return_routed_experts" in inspect.signature(SamplingParams).parameters
    llm = _start_vllm(bench, model, max_model_len=2 * length, native_capture=native)
    out = [model_finding(model, section)]
    first = _vllm_logprobs(llm, seqs, length)
    gap = compare.logprob_gap(got=first, want=ref, mask=mask)
    status, rule = compare.judge_bf16(gap, yardstick=yardstick)
    out += [
        finding(section, "vLLM bf16 vs HF fp32, mean |dlogp|", gap.mean, "nats", status, rule),
        finding(section, "vLLM bf16 vs HF fp32, max |dlogp|", gap.max, "nats", "info"),
    ]
    if bench.on_gpu:
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        freed = torch.cuda.mem_get_info()[0] - free_awake
        llm.wake_up()
        out.append(
            finding(
                section, "sleep(level=1) frees", freed / 2**30, "GiB", "ok" if freed > 0 else "fail", "> 0"
            )
        )
    else:
        out.append(finding(section, "sleep(level=1) frees", None, "", "skip", "GPU only; a no-op on CPU"))
        llm.sleep(level=1)
        llm.wake_up()
    d_wake = float((_vllm_logprobs(llm, seqs, length) - first)[mask].abs().max())
    status, rule = compare.judge_exact(d_wake)
    out.append(finding(section, "after wake_up vs before sleep, max |dlogp|", d_wake, "nats", status, rule))
    if native:
        out.append(_native_capture(bench, model, llm, seqs, section=section))
    else:
        why = (
            "needs CUDA (Model Runner V2, Triton)"
            if not bench.on_gpu
            else "this vLLM has no return_routed_experts"
        )
        out.append(finding(section, "native routed-expert capture", None, "", "skip", why))
    if bench.on_gpu:
        llm.sleep(level=2)  # hand the GPU memory back now, not whenever the engine is collected
    return out
