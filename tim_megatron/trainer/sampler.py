"""Sampling with the Megatron model itself (VeXact ``trainer_sampler`` mode).

Slow by design: no KV cache, one full forward per generated token. What it buys is a rollout that is
exactly the trainer's policy, routing included: no second implementation anywhere. Samples come from
softmax(logits / temperature) with per-sample seeds (top-p/top-k are not applied). Every rank runs the
whole batch with the same seeds, so TP/EP collectives line up and all ranks hold the same samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tim_megatron.rollout.base import Sample, sample_seed
from tim_megatron.trainer.logprobs import _logits, head_weight
from tim_megatron.trainer.model import final_hidden_states


@torch.no_grad()
def _last_logits(trainer, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    s = ids.shape[1]
    pad = (-s) % trainer.tp
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
    trainer.model.eval()
    hidden = final_hidden_states(trainer.model, ids.to(trainer._device()))
    if trainer.tp > 1 and trainer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    last = hidden[lengths - 1, torch.arange(ids.shape[0])]  # [b, h]
    local = _logits(last, head_weight(trainer.model), trainer.head)  # [b, V / tp], after temperature
    if trainer.tp > 1:
        parts = [torch.empty_like(local) for _ in range(trainer.tp)]
        dist.all_gather(parts, local.contiguous(), group=trainer.ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, -1)
    return local.float().cpu()


def sample_with_trainer(
    trainer,
    prompts: list[list[int]],
    *,
    step: int,
    eos_id: int,
    first_index: int = 0,
    n: int | None = None,
    greedy: bool = False,
) -> list[list[Sample]]:
    """``n`` samples of each prompt; ``first_index`` is the global index of ``prompts[0]`` (it seeds the samples).
    ``greedy`` takes the most likely token (validation)."""
    r = trainer.recipe.rollout
    n = r.n if n is None else n
    seqs = [list(p) for p in prompts for _ in range(n)]
    gens = [
        torch.Generator().manual_seed(sample_seed(trainer.recipe.run.seed, step, first_index + i // n, i % n))
        for i in range(len(seqs))
    ]
    plen = [len(s) for s in seqs]
    lps: list[list[float]] = [[] for _ in seqs]
    finish = ["length"] * len(seqs)
    active = list(range(len(seqs)))
    for _ in range(r.max_tokens):
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        ids = torch.zeros(len(active), width, dtype=torch.long)
        for row, i in enumerate(active):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        lengths = torch.tensor([len(seqs[i]) for i in active])
        logp = torch.log_softmax(_last_logits(trainer, ids, lengths), -1)
        still = []
        for row, i in enumerate(active):
            if greedy:
                tok = int(logp[row].argmax())
            else:
                tok = int(torch.multinomial(logp[row].exp(), 1, generator=gens[i]))
            seqs[i].append(tok)
            lps[i].append(float(logp[row, tok]))
            if tok == eos_id:
                finish[i] = "stop"
            else:
                still.append(i)
        active = still
    samples = [
        Sample(s[:p], s[p:], lp, f, prompt_index=first_index + k // n, sample_index=k % n)
        for k, (s, p, lp, f) in enumerate(zip(seqs, plen, lps, finish, strict=True))
    ]
    return [samples[k * n : (k + 1) * n] for k in range(len(prompts))]
