"""The Megatron trainer: a thin adapter from the RL loop to megatron-core.

It owns the model (GPTModel in megatron's Float16Module and DDP wrappers), the megatron-core optimizer
and this rank's place in the TP/EP/DP layout. It does three things for the loop:

* :meth:`MegatronTrainer.logprobs`: per-token logprobs (optionally entropy, low-precision logprobs and
  the routing it used) for a batch of sequences, without gradients;
* :meth:`MegatronTrainer.train_step`: one optimizer update over a minibatch, accumulating gradients over
  micro-batches, with a loss given by the loop (the math lives in ``tim_megatron.algo``);
* :meth:`MegatronTrainer.export_hf`: the weights in HF checkpoint layout, for the rollout engine.

Exact mode (``diagnostics.vexact: exact``) changes three things, all local: every product of the forward (linears,
routers, attention, the LM head) runs on row-invariant kernels (``patches/megatron/invariant_kernels.py``,
:mod:`tim_megatron.exact.kernels`), so a position's bits depend only on its own sequence up to it; callers can fix
every micro-batch's width (``width=``, :meth:`MegatronTrainer.exact_width`); and the exact sampler
(:mod:`tim_megatron.rollout.exact_sampler`) can decode through the same model with a KV cache
(:meth:`MegatronTrainer.decode_forward`) or with one full forward per token (:meth:`MegatronTrainer.sample_forward`).

Checkpoints are in :mod:`tim_megatron.trainer.checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from patches.megatron import (
    cpu_shims,
    distopt_checkpoint,
    invariant_kernels,
    router_replay,
    torch_adam_kernel,
)
from tim_megatron.algo.stats import Stats
from tim_megatron.comm import comm_device
from tim_megatron.modes import RunModes, modes_of
from tim_megatron.recipe.schema import Recipe
from tim_megatron.trainer import patching
from tim_megatron.trainer.attention import LayerKernels
from tim_megatron.trainer.compile import apply as compile_layers
from tim_megatron.trainer.experts import weights_layout
from tim_megatron.trainer.hf_config import check_dims_match, dims_from_hf, model_family, read_hf_config
from tim_megatron.trainer.kernel_choice import choose_kernels
from tim_megatron.trainer.logprobs import ChunkSampler, HeadSpec, TokenLogprobs, head_weight, token_logprobs
from tim_megatron.trainer.model import DTYPES, BuildOptions, build_model, final_hidden_states, unwrap
from tim_megatron.trainer.offload import PARTS, HostOffload, Transfer, trainer_tensors
from tim_megatron.trainer.parallel import DistEnv, init_parallel
from tim_megatron.trainer.weights import export_hf, load_hf_into_model


class NonFiniteAbort(RuntimeError):
    """Too many consecutive non-finite updates: the loop checkpoints the last good state and stops.

    Raised on every rank at the same update (the finiteness test is reduced over ranks). The skipped updates
    changed nothing, so the weights and optimizer state in memory are those of the last applied update; the
    loop saves them under the last completed step (with updates applied earlier in the aborting step, if
    the streak began mid-step)."""


@dataclass
class SeqBatch:
    """Sequences (prompt + response), right-padded."""

    input_ids: torch.Tensor
    """``[N, L]`` token ids."""
    lengths: torch.Tensor
    """``[N]`` real length of each sequence."""
    routed_experts: torch.Tensor | None = None
    """``[layers, N, L, top_k]`` expert ids to replay (position t: the experts used for input token t)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> SeqBatch:
        re = None if self.routed_experts is None else self.routed_experts[:, idx]
        return SeqBatch(self.input_ids[idx], self.lengths[idx], re)


@dataclass
class StepResult:
    applied: bool
    """The optimizer update was applied (False: skipped for non-finite gradients or fp16 overflow)."""
    grad_norm: float
    loss: float
    loss_scale: float
    stats: Stats
    times: dict[str, float] = field(default_factory=dict)


LossFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, Stats]]
"""(logprobs ``[n, w]`` of a micro-batch, the micro-batch's row indices into the batch, w) -> (loss, stats).

``w`` is never more than the batch's own width: positions the trainer pads on for its layout (a multiple of
TP for sequence parallelism, the longest micro-batch across ranks for expert-parallel dispatch) are cut off
before the loss sees them, so the loss can slice every ``[n, L]`` tensor of the batch with ``[:, :w]``."""


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class TrainerInputs:
    """What the trainer needs from recipe sections that are not its own, handed in by whoever builds it (the
    trainer reads only its own sections of ``recipe``: model, parallel, trainer, optim, remedies, diagnostics)."""

    response_budget: int
    """``rollout.max_tokens``: the tokens a response may add to its prompt (exact mode's micro-batch width)."""
    logprob_temperature: float
    """The temperature the head divides the logits by: ``rollout.temperature`` when the rollout logs logprobs
    after it (``rollout.logprobs_after_temperature``), else 1."""
    save_optimizer: bool
    """``checkpoint.save_optimizer``: checkpoints carry the optimizer's state."""

    @classmethod
    def of(cls, recipe: Recipe) -> TrainerInputs:
        ro = recipe.rollout
        return cls(
            response_budget=ro.max_tokens,
            logprob_temperature=ro.temperature if ro.logprobs_after_temperature else 1.0,
            save_optimizer=recipe.checkpoint.save_optimizer,
        )


class MegatronTrainer:
    @classmethod
    def of_run(
        cls, recipe: Recipe, *, model_path: str | Path, environ: dict[str, str] | None = None
    ) -> MegatronTrainer:
        """The trainer of a run of ``recipe``, with its :class:`TrainerInputs` taken from the same recipe."""
        return cls(recipe, model_path=model_path, environ=environ, inputs=TrainerInputs.of(recipe))

    def __init__(
        self,
        recipe: Recipe,
        *,
        model_path: str | Path,
        inputs: TrainerInputs,
        environ: dict[str, str] | None = None,
    ):
        self.recipe = recipe
        self.inputs = inputs
        self.modes: RunModes = modes_of(recipe)
        """The run's modes (:mod:`tim_megatron.modes`): the patches, kernels and routing below follow them."""
        self.model_path = Path(model_path)
        hf_cfg = read_hf_config(self.model_path)
        self.family = model_family(hf_cfg)
        self.dims = dims_from_hf(hf_cfg)
        check_dims_match(recipe.model.dims, self.dims, where=f"model.path = {self.model_path}")
        self._handles = patching.before_init(self.modes)
        self.env: DistEnv = init_parallel(
            recipe.parallel,
            seed=recipe.run.seed,
            environ=environ,
            timeout_minutes=recipe.parallel.timeout_minutes,
        )
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp = ps.get_tensor_model_parallel_world_size()
        self._handles += patching.after_init(self.modes)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.sequence_parallel = self.tp > 1
        self.dtype = recipe.trainer_dtype
        if recipe.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.kernel_choice = choose_kernels(recipe, self.modes, on_gpu=torch.cuda.is_available())
        """The kernels, as the doctor and the plan state them (:mod:`tim_megatron.trainer.kernel_choice`)."""
        self.kernels = LayerKernels(
            attention=self.kernel_choice.attention, experts=self.kernel_choice.experts
        )
        gpt = self._build()
        self.model = self._wrap(gpt)
        self.head = self._head(gpt)
        self.loaded_params, self.load_seconds = self._load_weights()
        self.optimizer_kernel = self.kernel_choice.optimizer
        """The Adam kernel this trainer steps with where megatron falls back to torch's AdamW
        (``trainer.optimizer_kernel``; ``auto``: fused on CUDA, foreach on CPU); a checkpoint load keeps it."""
        self.optimizer = self._optimizer()
        self.host = HostOffload(device=self._device())
        """Where the state goes while the rollout engine generates (``trainer.offload_during_rollout``)."""
        self.nonfinite_streak = 0
        self.updates = 0

    @property
    def exact(self) -> bool:
        """Exact mode (``modes.exact``)."""
        return self.modes.exact

    @property
    def replay_enabled(self) -> bool:
        """Router replay's hooks are attached (``modes.routing.hooks``)."""
        return self.modes.routing.hooks

    # ------------------------------------------------------------------------------------------ build

    def _build(self):
        """megatron-core's GPT model from the dims, with the modes' patches on it."""
        r = self.recipe
        gpt = build_model(
            self.dims,
            r.model,
            r.parallel,
            BuildOptions(
                dtype=self.dtype,
                dispatcher=self.modes.dispatcher or r.trainer.moe_dispatcher,
                routing_replay=self.replay_enabled,
                recompute=r.trainer.recompute,
                kernels=self.kernels,
            ),
        )
        self.exact_admission = patching.on_model(self.modes, gpt, device=self._device())
        """Exact mode: which row-invariant kernels the device's check admitted, and which it refused (else None)."""
        self.compiled = compile_layers(
            gpt, setting=r.trainer.compile, exact=self.exact, on_gpu=torch.cuda.is_available()
        )
        """``trainer.compile``'s compiled functions on this model (:mod:`tim_megatron.trainer.compile`)."""
        self._handles.append(self.compiled)
        return gpt

    def _load_weights(self) -> tuple[int, float]:
        """The HF checkpoint's weights into the model: (parameters loaded, seconds)."""
        t = time.perf_counter()
        n = load_hf_into_model(self.model, self.model_path, family=self.family, dims=self.dims)
        return n, time.perf_counter() - t

    def _head(self, gpt) -> HeadSpec:
        r = self.recipe
        return HeadSpec(
            temperature=self.inputs.logprob_temperature,
            chunk=r.trainer.logprob_chunk,
            fp32=r.remedies.fp32_lm_head,
            kernels=invariant_kernels.kernels_of(gpt),
        )

    def _wrap(self, gpt):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        module = gpt
        if self.dtype != "float32":
            module = Float16Module(gpt.config, gpt)
        use_dist_opt = self._use_distributed_optimizer()
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_dist_opt,
            check_for_nan_in_grad=False,
            bucket_size=None,
        )
        with cpu_shims.cuda_placement_to_cpu():
            return DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=module)

    def _use_distributed_optimizer(self) -> bool:
        explicit = self.recipe.trainer.distributed_optimizer
        if explicit is not None:
            if explicit and not torch.cuda.is_available():
                raise ValueError(
                    "trainer.distributed_optimizer = true needs CUDA (megatron's distributed optimizer)"
                )
            return explicit
        return torch.cuda.is_available()

    def _optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, t = self.recipe.optim, self.recipe.trainer
        cfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=0.0,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.grad_clip,
            bf16=self.dtype == "bfloat16",
            fp16=self.dtype == "float16",
            params_dtype=unwrap(self.model).config.params_dtype,
            use_distributed_optimizer=self._use_distributed_optimizer(),
            loss_scale=None,
            initial_loss_scale=t.initial_loss_scale,
            min_loss_scale=t.min_loss_scale,
            loss_scale_window=t.loss_scale_window,
            hysteresis=1,
        )
        with cpu_shims.cuda_placement_to_cpu():
            optimizer = get_megatron_optimizer(cfg, [self.model])
        torch_adam_kernel.set_kernel(optimizer, self.optimizer_kernel)
        return optimizer

    # ----------------------------------------------------------------------------------------- layout

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    def rank_rows(self, n: int) -> slice:
        """Rows of a global batch of ``n`` sequences that this data-parallel rank handles."""
        if n % self.dp_size:
            raise ValueError(
                f"a batch of {n} sequences does not split over parallel.dp = {self.dp_size} ranks"
            )
        per = n // self.dp_size
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def num_moe_layers(self) -> int:
        return self.dims.num_moe_layers

    # -------------------------------------------------------------------------------------- forwards

    def micro_batches(self, n: int) -> Iterator[torch.Tensor]:
        """The rows of each micro-batch of a batch of ``n`` sequences, in order."""
        mbs = self.recipe.trainer.micro_batch_size
        for start in range(0, n, mbs):
            yield torch.arange(start, min(start + mbs, n))

    def exact_width(self, longest_prompt: int) -> int:
        """Exact mode's micro-batch width: the longest prompt of the step on any rank plus the generation budget,
        rounded up for TP (every rank calls it: the maximum is all-reduced)."""
        w = torch.tensor([longest_prompt + self.inputs.response_budget], device=self._device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
        return _round_up(max(int(w.item()), 2), self.tp)

    def _trimmed(self, batch: SeqBatch, rows: torch.Tensor, width: int | None = None) -> tuple[SeqBatch, int]:
        mb = batch.select(rows)
        if width is not None:  # exact mode: the width the sampler used, whatever the rows hold
            if int(mb.lengths.max()) > width or width % self.tp:
                raise ValueError(
                    f"micro-batch width {width}: rows up to {int(mb.lengths.max())} tokens, TP {self.tp}"
                )
            s = width
        else:
            s = _round_up(max(int(mb.lengths.max()), 2), self.tp)
        if width is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Expert-parallel dispatch exchanges equal-sized token blocks: every rank pads to the same length.
            t = torch.tensor([s], device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            s = int(t.item())
        ids = mb.input_ids[:, :s]
        if ids.shape[1] < s:  # pad to a multiple of TP for sequence parallelism
            ids = torch.nn.functional.pad(ids, (0, s - ids.shape[1]), value=0)
        re = mb.routed_experts
        if re is not None:
            re = re[:, :, :s]
            if re.shape[2] < s:
                re = torch.nn.functional.pad(re, (0, 0, 0, s - re.shape[2]), value=0)
        return SeqBatch(ids, mb.lengths, re), s

    def _replay_indices(self, routed: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """``[layers, b, s, k]`` -> per layer ``[s_local * b, k]`` in the router's token order."""
        layers, b, s, k = routed.shape
        routed = routed.long().clone()
        pos = torch.arange(s).view(1, 1, s)
        beyond = (
            pos >= lengths.view(1, b, 1) - 1
        )  # last token and padding: outputs unused, any valid set works
        routed[beyond.expand(layers, b, s)] = torch.arange(k, dtype=torch.long)
        if self.sequence_parallel:
            r = self.ps.get_tensor_model_parallel_rank()
            per = s // self.tp
            routed = routed[:, :, r * per : (r + 1) * per]
        dev = self._device()
        return [routed[layer].permute(1, 0, 2).reshape(-1, k).to(dev) for layer in range(layers)]

    def _gather_recorded(self, recorded: list[torch.Tensor], b: int, s: int) -> torch.Tensor:
        """Per layer ``[s_local * b, k]`` -> ``[layers, b, s, k]``."""
        out = []
        for idx in recorded:
            k = idx.shape[-1]
            x = idx.view(-1, b, k)
            if self.sequence_parallel:
                parts = [torch.empty_like(x) for _ in range(self.tp)]
                dist.all_gather(parts, x.contiguous(), group=self.ps.get_tensor_model_parallel_group())
                x = torch.cat(parts, 0)
            out.append(x.permute(1, 0, 2).cpu())
        return torch.stack(out)

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kw) -> TokenLogprobs:
        """The forward every pass runs: model to the final norm, then the chunked head (``kw``: token_logprobs')."""
        self.require_resident(("params",), "a forward")
        hidden = final_hidden_states(self.model, ids.to(self._device()), position_ids)
        return token_logprobs(
            hidden=hidden,
            input_ids=ids.to(self._device()),
            weight=head_weight(self.model),
            spec=self.head,
            sequence_parallel=self.sequence_parallel,
            **kw,
        )

    @torch.no_grad()
    def logprobs(
        self,
        batch: SeqBatch,
        *,
        with_entropy: bool = False,
        routing: str = "off",
        width: int | None = None,
    ) -> tuple[TokenLogprobs, torch.Tensor | None]:
        """Logprobs ``[N, L]`` of every token (position t: log p(token t | < t)); optionally the routing.

        routing: ``off``; ``record`` (also return ``[layers, N, L, k]`` expert ids used); ``replay``
        (use ``batch.routed_experts``). width: pad every micro-batch to exactly this many positions (exact mode's
        :meth:`exact_width`) instead of its longest row.
        """
        self.model.eval()
        n, cols = batch.input_ids.shape
        lp = torch.zeros(n, cols)
        ent = torch.zeros(n, cols) if with_entropy else None
        routed = None
        with self.weights_fixed():
            for rows in self.micro_batches(n):
                mb, s = self._trimmed(batch, rows, width)
                keep = min(s, cols)
                with self._routing(routing, mb) as rec:
                    out = self._forward(mb.input_ids, with_entropy=with_entropy)
                lp[rows, :keep] = out.logprobs[:, :keep].float().cpu()
                if ent is not None:
                    ent[rows, :keep] = out.entropy[:, :keep].float().cpu()
                if routing == "record":
                    rec_t = self._gather_recorded(rec.indices, len(rows), s)
                    if routed is None:
                        routed = torch.zeros(rec_t.shape[0], n, cols, rec_t.shape[-1], dtype=torch.int16)
                    routed[:, rows, :keep] = rec_t[:, :, :keep].to(torch.int16)
        self._check_clean()
        beyond = (
            torch.arange(cols)[None, :] >= batch.lengths[:, None]
        )  # padding: defined as 0 whatever the layout
        for t in (lp, ent):
            if t is not None:
                t.masked_fill_(beyond, 0.0)
        return TokenLogprobs(lp, ent), routed

    @torch.no_grad()
    def sample_forward(
        self, ids: torch.Tensor, sampler: ChunkSampler, *, record: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact mode: one forward of a micro-batch ``[b, W]`` (W from :meth:`exact_width`) in which ``sampler``
        picks each row's next token from the head's logits. Returns the logprobs ``[b, W]`` of that forward, the
        sampled tokens' included (the chunks the sampler skips read 0), and with ``record`` the experts each
        position was routed to, ``[layers, b, W, k]``."""
        if not self.exact:
            raise RuntimeError("sample_forward is exact mode's (diagnostics.vexact = exact)")
        self.model.eval()
        mb = SeqBatch(ids, torch.full((ids.shape[0],), ids.shape[1]))
        with self._routing("record" if record else "off", mb) as rec:
            out = self._forward(ids, sampler=sampler)
        self._check_clean()
        routed = self._gather_recorded(rec.indices, ids.shape[0], ids.shape[1]) if record else None
        return out.logprobs.float().cpu(), routed

    def weights_fixed(self) -> contextlib.AbstractContextManager:
        """A span in which the caller leaves the weights as they are: exact mode's kernels widen each 16-bit
        weight once inside it (:class:`~tim_megatron.exact.kernels.WideWeights`), not once per forward."""
        kernels = invariant_kernels.kernels_of(self.model)
        return kernels.wide.held() if kernels is not None else contextlib.nullcontext()

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a forward reads that an update can change: the parameters and the floating buffers (a
        router's expert bias)."""
        out = dict(self.model.named_parameters())
        out.update((f"buffer:{n}", b) for n, b in self.model.named_buffers() if b.is_floating_point())
        return out

    def weights_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the weights as they are now, for :meth:`weights_at` after later updates (the overlapped
        off-policy schedule scores a batch at its sampling weights after the update that ran beside it)."""
        self.require_resident(("params",), "a weight snapshot")
        return {n: t.detach().clone() for n, t in self._weight_tensors().items()}

    @contextlib.contextmanager
    def weights_at(self, snapshot: dict[str, torch.Tensor]):
        """``with trainer.weights_at(snap):`` the model computes with the snapshot's weights inside, and with its
        own again after, bit for bit. The two are swapped tensor by tensor (the snapshot holds the model's own
        weights meanwhile), so no second copy of the model is made."""
        tensors = self._weight_tensors()
        if tensors.keys() != snapshot.keys():
            raise ValueError(
                f"a weight snapshot of {len(snapshot)} tensors does not fit this model's {len(tensors)}"
            )
        _swap(tensors, snapshot)
        try:
            yield
        finally:
            _swap(tensors, snapshot)

    def exact_cache_dtype(self) -> torch.dtype:
        """The dtype exact mode's KV cache stores keys and values in: the model's, as the training forward holds
        them (the kernels widen a bfloat16 key on every read to the float32 value a wide cache would have held:
        the same bits, half the bytes)."""
        return DTYPES[self.dtype]

    @torch.no_grad()
    def decode_forward(
        self,
        ids: torch.Tensor,
        *,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache,
        sampler: ChunkSampler,
        record: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact mode's cached step: the entries ``ids [1, n]`` (entry i: token at ``positions[i]`` of cache row
        ``rows[i]``) go through the model as one sequence; each layer writes their keys and values into ``cache``
        (a :class:`~tim_megatron.exact.kv_cache.KVCache` as wide as the training forward) and attends over the
        rows' buffers. ``sampler`` picks next tokens from the entries it wants (its positions are entry indices).
        Returns the logprobs ``[n]`` (entry i's sampled token at ``i + 1``, as in :func:`token_logprobs`) and, with
        ``record``, the experts of every entry ``[layers, n, k]``."""
        if not self.exact:
            raise RuntimeError("decode_forward is exact mode's (diagnostics.vexact = exact)")
        if self.model.training:  # once per rollout: eval() walks every module
            self.model.eval()
        dev = self._device()
        ids = ids.to(dev)
        mb = SeqBatch(ids, torch.full((1,), ids.shape[1]))
        with (
            invariant_kernels.decoding(
                self.model, cache=cache, rows=rows.to(dev), positions=positions.to(dev)
            ),
            self._routing("record" if record else "off", mb) as rec,
        ):
            out = self._forward(ids, sampler=sampler, position_ids=positions.view(1, -1).to(dev))
        self._check_clean()
        routed = self._gather_recorded(rec.indices, 1, ids.shape[1])[:, 0] if record else None
        return out.logprobs[0].float().cpu(), routed

    def _routing(self, mode: str, mb: SeqBatch):
        import contextlib

        if mode == "off" or not self.dims.is_moe:
            return contextlib.nullcontext()
        if not self.replay_enabled:
            raise RuntimeError(
                f"routing = {mode} needs remedies.router_replay != off (the model has no replay hooks)"
            )
        if mode == "record":
            return router_replay.replay(self.model, action="record")
        if mb.routed_experts is None:
            raise ValueError("routing = replay but the batch carries no routed_experts")
        return router_replay.replay(
            self.model, action="replay", indices=self._replay_indices(mb.routed_experts, mb.lengths)
        )

    def _check_clean(self) -> None:
        if self.replay_enabled and not router_replay.is_clean(self.model):
            raise RuntimeError("router replay state leaked out of a forward pass")

    # ----------------------------------------------------------------------------------------- update

    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, lr: float, routing: str = "off") -> StepResult:
        """One optimizer update over ``batch`` (this rank's share of a minibatch)."""
        loss, stats, times = self.backward(batch, loss_fn, routing=routing)
        result = self.step(lr=lr, loss=loss)
        result.stats = stats
        result.times = {**times, **result.times}
        return result

    def backward(
        self, batch: SeqBatch, loss_fn: LossFn, *, routing: str = "off"
    ) -> tuple[float, Stats, dict[str, float]]:
        """Accumulate gradients of ``loss_fn`` over the micro-batches of ``batch``, reduced over DP and TP."""
        from megatron.core.distributed import finalize_model_grads

        self.require_resident(PARTS, "a backward")
        self.model.train()
        self.model.zero_grad_buffer()
        with cpu_shims.cuda_placement_to_cpu():
            self.optimizer.zero_grad()
        stats = Stats()
        total_loss = 0.0
        t0 = time.perf_counter()
        width = batch.input_ids.shape[1]
        with self.weights_fixed():  # the optimizer step comes after
            for rows in self.micro_batches(len(batch)):
                mb, s = self._trimmed(batch, rows)
                keep = min(s, width)  # the layout's padding never reaches the loss
                with self._routing(routing, mb):
                    out = self._forward(mb.input_ids)
                    loss, st = loss_fn(out.logprobs[:, :keep].float(), rows, keep)
                    with cpu_shims.cuda_placement_to_cpu():
                        scaled = self.optimizer.scale_loss(loss)
                    scaled.backward()
                stats.merge(st)
                total_loss += float(loss.detach())
        self._check_clean()
        finalize_model_grads([self.model])
        return total_loss, stats, {"fwd_bwd": time.perf_counter() - t0}

    def step(self, *, lr: float, loss: float = 0.0) -> StepResult:
        """Apply the accumulated gradients (skipped when they are not finite; see trainer.nan_guard_max)."""
        self.require_resident(PARTS, "an optimizer step")
        kernels = invariant_kernels.kernels_of(self.model)
        if kernels is not None and kernels.wide.holding:
            raise RuntimeError("an optimizer step inside weights_fixed(): the widened weights would go stale")
        t1 = time.perf_counter()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # fp16: inf/nan gradients are loss-scale overflow, which megatron's grad scaler skips and backs off
        # from by itself; only a non-finite loss counts against the guard.
        finite = self._all_finite(loss, grads=self.dtype != "float16")
        applied, grad_norm = False, float("nan")
        if finite or self.dtype == "float16":  # fp16: megatron's scaler skips and backs off by itself
            with cpu_shims.cuda_placement_to_cpu():
                applied, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else float("nan")
        if applied:
            self.updates += 1
        if finite:
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            if self.nonfinite_streak > self.recipe.trainer.nan_guard_max:
                raise NonFiniteAbort(
                    f"{self.nonfinite_streak} consecutive updates had non-finite loss or gradients "
                    f"(trainer.nan_guard_max = {self.recipe.trainer.nan_guard_max})"
                )
        with cpu_shims.cuda_placement_to_cpu():
            scale = float(self.optimizer.get_loss_scale())
        return StepResult(
            applied=applied,
            grad_norm=grad_norm,
            loss=loss,
            loss_scale=scale,
            stats=Stats(),
            times={"optimizer": time.perf_counter() - t1},
        )

    def _all_finite(self, loss: float, *, grads: bool) -> bool:
        """Loss (and gradients) finite on every rank: the ranks agree, so they skip and abort together."""
        good = math.isfinite(loss) and (not grads or self._grads_finite())
        ok = torch.tensor([1.0 if good else 0.0], device=comm_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item() > 0)

    def _grads_finite(self) -> bool:
        """Every gradient finite (:func:`all_finite`), over megatron's contiguous gradient buffers: one read of
        each, no copy, one host sync."""
        buffers = list(getattr(self.model, "buffers", [])) + list(
            getattr(self.model, "expert_parallel_buffers", [])
        )
        grads = [b.grad_data for b in buffers if b.grad_data is not None]
        if not grads:
            for p in unwrap(self.model).parameters():
                g = getattr(p, "main_grad", None)
                grads.append(p.grad if g is None else g)
        return all_finite([g for g in grads if g is not None])

    # ------------------------------------------------------------------------------------------ export

    def export_hf(
        self, dtype: torch.dtype | None = None, *, grads: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights (or, with ``grads``, the reduced gradients) in HF checkpoint names and shapes."""
        self.require_resident(("params", "grads") if grads else ("params",), "an export")
        return export_hf(self.model, family=self.family, dims=self.dims, dtype=dtype, grads=grads)

    def offload(self, parts: tuple[str, ...]) -> Transfer:
        """Move ``parts`` of the state (see :mod:`tim_megatron.trainer.offload`) to host memory, and give the
        freed device memory back to the device."""
        moved = self.host.offload(trainer_tensors(self.model, self.optimizer), parts)
        self.release_memory()
        return moved

    def onload(self) -> Transfer:
        """Bring back whatever :meth:`offload` moved (nothing to do when nothing is away)."""
        return self.host.onload()

    def require_resident(self, parts: tuple[str, ...], doing: str) -> None:
        away = [p for p in self.host.offloaded if p in parts]
        if away:
            raise RuntimeError(
                f"the trainer's {', '.join(away)} are in host memory (trainer.offload_during_rollout): "
                f"{doing} needs them back first (trainer.onload())"
            )

    # ------------------------------------------------------------------------------------------ state

    def checkpoint_state(self, *, loading: bool) -> dict:
        """The model's (and, with ``checkpoint.save_optimizer``, the optimizer's) sharded state dict, as
        megatron-core's ``dist_checkpointing`` saves it or, with ``loading``, fills it."""
        self.require_resident(("params", "grads", "optimizer"), "a checkpoint")
        msd = unwrap(self.model).sharded_state_dict()
        out = {"model": msd}
        if self.inputs.save_optimizer:
            with cpu_shims.cuda_placement_to_cpu():
                if loading:
                    distopt_checkpoint.prime(self.optimizer)
                out["optimizer"] = self.optimizer.sharded_state_dict(
                    msd, is_loading=loading, metadata=dict(distopt_checkpoint.SHARDING)
                )
        return out

    def restore_state(self, loaded: dict) -> None:
        """Load what :meth:`checkpoint_state` filled (``ValueError`` if the optimizer's steps cannot be restored)."""
        unwrap(self.model).load_state_dict(loaded["model"])
        if "optimizer" in loaded:
            # no_grad: with an fp32 model the distributed optimizer's master weights are the parameters themselves
            with cpu_shims.cuda_placement_to_cpu(), torch.no_grad():
                self.optimizer.load_state_dict(loaded["optimizer"])
            distopt_checkpoint.restore_steps(self.optimizer, loaded["optimizer"])
            torch_adam_kernel.set_kernel(
                self.optimizer, self.optimizer_kernel
            )  # the load took the saved flags

    def state_meta(self) -> dict:
        """What a checkpoint records of the trainer beside its tensors: the updates applied, the model's dims, and
        the expert weights' layout when megatron's distributed optimizer saves its state by gradient bucket
        (:func:`~tim_megatron.trainer.experts.bucket_resume_problem`)."""
        buckets = self._use_distributed_optimizer() and self.inputs.save_optimizer
        return {
            "updates": self.updates,
            "model_dims": self.recipe.model.dims.model_dump(mode="json"),
            "optimizer_buckets": weights_layout(self.kernels.experts) if buckets else None,
        }

    def restore_meta(self, meta: dict) -> None:
        """The counters of :meth:`state_meta`, from a checkpoint's ``state.json``."""
        self.updates = meta.get("updates", 0)

    def release_memory(self) -> None:
        """Give the allocator's cached blocks back (before the rollout engine takes its memory again)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def head_changed(self, **changes):
        """``with trainer.head_changed(temperature=1.0):`` the head computes with these settings inside, and with
        its own again after (an engine's prompt logprobs, which the checks compare against, are at T = 1)."""
        head = self.head
        self.head = replace(head, **changes)
        try:
            yield
        finally:
            self.head = head

    def close(self, *, keep_default_group: bool = False) -> None:
        """Revert this trainer's patches and destroy its process groups (see
        :func:`~tim_megatron.trainer.parallel.teardown_parallel` for ``keep_default_group``)."""
        from tim_megatron.trainer.parallel import teardown_parallel

        for h in reversed(self._handles):
            h.revert()
        self._handles.clear()
        teardown_parallel(keep_default_group=keep_default_group)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No inf or NaN in any of ``tensors``: each tensor's min and max in one reduction (``aminmax`` reads it once,
    allocates nothing its size and propagates NaN; an inf is the min or the max), then one host sync for all of
    them. (A sum would read once too, but a float32 sum of finite values can overflow, and a float64 sum first copies
    the buffer to float64: 8 bytes per gradient.)"""
    ends = [torch.stack(torch.aminmax(t.detach())) for t in tensors if t.numel()]
    if not ends:
        return True
    return bool(torch.isfinite(torch.cat(ends)).all())


def _swap(tensors: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    """Exchange the values of same-named tensors, one temporary tensor at a time."""
    with torch.no_grad():
        for n, t in tensors.items():
            tmp = t.detach().clone()
            t.copy_(other[n])
            other[n].copy_(tmp)
