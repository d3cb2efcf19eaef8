"""One side's record of the same token sequences, layer by layer, and how each side makes it.

A :class:`Capture` holds, for every token of every sequence (rows in sequence order, positions in order):

* per decoder layer ``i``: ``("attention", i)`` the residual stream after attention and ``("mlp", i)`` after the
  MLP or MoE block ``[T, hidden]``; for a MoE layer also ``("router_logits", i)`` ``[T, experts]``, ``("topk", i)``
  the chosen expert ids and ``("gates", i)`` their gating weights ``[T, k]`` (ids ascending, weights in the same
  order, before a family's routed scaling factor);
* ``("final_norm", 0)`` the final norm's output ``[T, hidden]`` and ``("logprobs", 0)`` the head's logprob of each
  token given its prefix ``[T]`` (position 0 of each sequence: 0).

The trainer's record comes from forward hooks on megatron-core's modules (the decoder layers, each layer's
``pre_mlp_layernorm`` input, its router, the final layernorm), gathered over sequence-parallel ranks; the engine's
from :mod:`patches.vllm.align_capture`; the HF transformers model's (the float32 reference) from forward hooks on
its decoder layers, ``post_attention_layernorm`` inputs, routers and final norm. None copies a model's code.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

PER_LAYER = ("attention", "router_logits", "topk", "gates", "mlp")
"""The per-layer components, in the order a layer computes them."""
FINAL = ("final_norm", "logprobs")


@dataclass
class Capture:
    """One side's record (see the module docstring for the keys)."""

    side: str
    """``engine``, ``trainer`` or ``hf``."""
    lengths: list[int]
    """Each sequence's length: the rows of sequence j are the ``lengths[j]`` rows after the earlier sequences'."""
    num_layers: int
    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def add(self, part: dict[tuple[str, int], torch.Tensor]) -> None:
        """Append one sequence's tensors (rows in position order) to the record, each layer's expert ids put in
        ascending order with their gates (:func:`sorted_topk`), whatever order its side chose them in."""
        part = dict(part)
        for _, i in [key for key in part if key[0] == "topk"]:
            part[("topk", i)], part[("gates", i)] = sorted_topk(part[("topk", i)].long(), part[("gates", i)])
        for key, value in part.items():
            have = self.tensors.get(key)
            self.tensors[key] = value if have is None else torch.cat([have, value])

    def get(self, component: str, layer: int = 0) -> torch.Tensor | None:
        return self.tensors.get((component, layer))


def sorted_topk(ids: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ascending within each row, the gating weights moved with them."""
    order = ids.argsort(dim=-1, stable=True)
    return ids.gather(-1, order), gates.gather(-1, order)


# -------------------------------------------------------------------------------------------- trainer


@contextlib.contextmanager
def _trainer_hooks(trainer, rec: dict):
    """Forward hooks on the trainer's model that fill ``rec`` (key -> tensor ``[rows, ...]`` in sequence order,
    gathered over the sequence-parallel ranks); removed on exit."""
    from tim_megatron.trainer.model import unwrap

    gpt = unwrap(trainer.model)
    gather = _sequence_gather(trainer)
    k = trainer.dims.num_experts_per_tok

    def put(key, t: torch.Tensor) -> None:
        rec[key] = gather(t.detach()).float().cpu().clone()  # the forward may reuse the buffer

    def on_router(router, args, output, i):
        hidden = args[0]
        logits = router.gating(hidden).reshape(-1, router.weight.shape[0])  # the forward's own GEMM, again
        probs, routing_map = output
        ids = torch.argsort((~routing_map).to(torch.int8), dim=-1, stable=True)[
            :, :k
        ]  # chosen ids, ascending
        put(("router_logits", i), logits)
        put(("topk", i), ids)
        # vLLM's router returns the weights before the routed scaling factor (applied when the experts' outputs
        # are combined); megatron-core's probabilities include it. Compared before it, on both sides.
        scale = router.config.moe_router_topk_scaling_factor or 1.0
        put(("gates", i), probs.gather(-1, ids) / scale)

    handles = []
    for i, layer in enumerate(gpt.decoder.layers):
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: put(("mlp", i), _first(out))))
        handles.append(
            layer.pre_mlp_layernorm.register_forward_pre_hook(lambda m, a, i=i: put(("attention", i), a[0]))
        )
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            handles.append(router.register_forward_hook(lambda m, a, out, i=i: on_router(m, a, out, i)))
    handles.append(
        gpt.decoder.final_layernorm.register_forward_hook(
            lambda m, a, out: put(("final_norm", 0), _first(out))
        )
    )
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _sequence_gather(trainer):
    """Whole-sequence tensors from this rank's sequence-parallel slice (identity without sequence parallelism)."""
    if not trainer.sequence_parallel:
        return lambda t: t
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return lambda t: gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False)


def trainer_capture(
    trainer, sequences: list[list[int]], *, replay: list[torch.Tensor] | None = None
) -> Capture:
    """The trainer's record of ``sequences``, one forward each at T = 1 (the engine's prompt logprobs are at
    T = 1). ``replay``: per sequence, the experts ``[moe_layers, len, k]`` to route with (R3); None: its own."""
    from tim_megatron.trainer.megatron_trainer import SeqBatch

    layers = len(decoder_layers(trainer))
    cap = Capture("trainer", [len(s) for s in sequences], layers)
    for j, seq in enumerate(sequences):
        n = len(seq)
        routed = None if replay is None else replay[j][:, None].to(torch.int16)  # [layers, 1, n, k]
        batch = SeqBatch(torch.tensor([seq]), torch.tensor([n]), routed)
        rec: dict = {}
        with _trainer_hooks(trainer, rec), trainer.head_changed(temperature=1.0):
            lp, _ = trainer.logprobs(batch, routing="off" if replay is None else "replay")
        part = {key: _rows(value, n) for key, value in rec.items()}
        part[("logprobs", 0)] = lp.logprobs[0, :n].float()
        cap.add(part)
    return cap


def decoder_layers(trainer) -> list:
    """The trainer model's decoder layers (one pipeline stage)."""
    from tim_megatron.trainer.model import unwrap

    return list(unwrap(trainer.model).decoder.layers)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, 1, ...]`` or ``[s, ...]`` (one sequence, possibly padded) to its first ``n`` rows."""
    if t.dim() >= 3 and t.shape[1] == 1:
        t = t[:, 0]
    return t[:n]


# --------------------------------------------------------------------------------------------- engine


def engine_capture(engine, sequences: list[list[int]], *, num_layers: int) -> Capture:
    """The vLLM engine's record of ``sequences``: each scored alone (prompt logprobs at T = 1, one token
    generated), the prefix cache reset first so every position is computed."""
    from patches.vllm import align_capture

    cap = Capture("engine", [len(s) for s in sequences], num_layers)
    routers = align_capture.install(engine.llm)
    try:
        if routers != engine.num_moe_layers:
            raise RuntimeError(
                f"tim align: {routers} of vLLM's MoE routers report their top-k to the capture; the model has "
                f"{engine.num_moe_layers} MoE layers"
            )
        for seq in sequences:
            engine.reset_prefix_cache()
            align_capture.begin(engine.llm)
            (scores,) = engine.score([seq])
            part = {key: value[: len(seq)] for key, value in align_capture.end(engine.llm).items()}
            missing = [
                f"{c} {i}"
                for i in range(num_layers)
                for c in ("attention", "mlp")
                if (c, i) not in part or len(part[(c, i)]) != len(seq)
            ]
            if missing or ("final_norm", 0) not in part:
                raise RuntimeError(
                    f"tim align: vLLM's model recorded no rows for {missing or ['the final norm']} of a "
                    f"{len(seq)}-token sequence (a layer its hooks do not reach)"
                )
            part[("logprobs", 0)] = torch.tensor(scores, dtype=torch.float32)
            cap.add(part)
    finally:
        align_capture.uninstall(engine.llm)
    return cap


# ------------------------------------------------------------------------------------ HF transformers


def hf_routers(layer) -> list:
    """A HF decoder layer's MoE router: transformers 5 names its class ``...TopKRouter`` (``...TopkRouter`` for
    GLM-4.5); it returns (router logits, top-k weights, top-k ids)."""
    return [m for m in layer.modules() if type(m).__name__.lower().endswith("topkrouter")]


def hf_capture(model, sequences: list[list[int]], *, dims) -> Capture:
    """The HF transformers model's record of ``sequences`` (the reference: load it in float32), one forward each,
    through forward hooks: each decoder layer's output, each ``post_attention_layernorm``'s input, the router's
    logits, ids and weights (divided by ``dims.routed_scaling_factor``, which GLM-4.5's router applies inside),
    the final norm, and the logprobs of the model's own logits."""
    layers = list(model.model.layers)
    rec: dict = {}

    def put(key, t: torch.Tensor) -> None:
        rec[key] = t.detach().reshape(-1, *t.shape[2:]) if t.dim() == 3 else t.detach()

    def on_router(out, i):
        logits, weights, ids = out
        put(("router_logits", i), logits.float())
        put(("topk", i), ids.long())
        put(("gates", i), weights.float() / dims.routed_scaling_factor)

    handles, routed = [], 0
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_hook(lambda m, a, out, i=i: put(("mlp", i), _first(out).float()))
        )
        handles.append(
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: put(("attention", i), a[0].float())
            )
        )
        for router in hf_routers(layer)[:1]:
            routed += 1
            handles.append(router.register_forward_hook(lambda m, a, out, i=i: on_router(out, i)))
    handles.append(
        model.model.norm.register_forward_hook(lambda m, a, out: put(("final_norm", 0), out.float()))
    )
    cap = Capture("hf", [len(s) for s in sequences], len(layers))
    try:
        if routed != dims.num_moe_layers:
            raise RuntimeError(
                f"tim align: {routed} of the HF model's layers have a router its hooks recognise (a module named "
                f"...TopKRouter); the model has {dims.num_moe_layers} MoE layers"
            )
        for seq in sequences:
            rec.clear()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            part = {key: value.clone() for key, value in rec.items()}
            part[("logprobs", 0)] = torch.cat([torch.zeros(1), lp])
            cap.add(part)
    finally:
        for h in handles:
            h.remove()
    return cap
