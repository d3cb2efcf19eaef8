"""Token dumps: one parquet file per dump step, one row per response token, for the report.

Columns: step, seq (the global row: prompt x group size + sample), prompt, sample, engine (the rollout engine
that generated it), finish (0 stop, 1 length, 2 other), position, token_id, version (updates applied to the weights
that sampled the token: with partial rollouts it varies along a response), pi_train (trainer, old weights),
pi_infer (rollout engine), pi_old (the old policy the loss used: pi_train, or pi_infer in bypass mode), pi_sampled
(the trainer at the token's sampling weights), log_ratio_staleness, log_ratio_tim and log_ratio_total (float64: log
pi_old - log pi_sampled, log pi_sampled - log pi_infer, and log pi_old - log pi_infer, which the two parts add up to
within float64 rounding), advantage, reward, and
optionally routed_experts (the expert ids the trainer replays under R3 at the position that produced the token:
the rollout engine's, of the call that sampled it; ``layers x top_k`` flattened).

A dump is written in memory, then replaces its file by an atomic rename, inside the run folder when one is
given: a link planted at its name or at ``dumps/`` is never written through.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tim_megatron.safe_files import check_inside, write_atomic


def write_dump(
    path: Path,
    *,
    step: int,
    mask: torch.Tensor,
    input_ids: torch.Tensor,
    train_lp: torch.Tensor | None,
    infer_lp: torch.Tensor,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    rows: torch.Tensor | None = None,
    group_size: int = 1,
    engine: torch.Tensor | None = None,
    finish: torch.Tensor | None = None,
    routed: torch.Tensor | None = None,
    max_tokens: int = 200_000,
    seed: int = 0,
    root: Path | None = None,
    sampled_lp: torch.Tensor | None = None,
    version: torch.Tensor | None = None,
) -> int:
    """Write the step's tokens to ``path`` (inside folder ``root`` when given); returns the number of rows.
    ``sampled_lp``: the trainer's logprobs at the weights that sampled the tokens (an off-policy batch; None: the
    old pass's), for the columns that split each token's log-ratio into staleness and TIM. ``version``: ``[n, L]``
    the version of the weights that sampled each token (None: ``step - 1`` for all, an on-policy step's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seq, pos = torch.nonzero(mask, as_tuple=True)
    n = seq.numel()
    if n > max_tokens:  # uniform subsample, reproducible
        keep = (
            torch.randperm(n, generator=torch.Generator().manual_seed(seed + step))[:max_tokens].sort().values
        )
        seq, pos = seq[keep], pos[keep]
    row = (rows if rows is not None else torch.arange(mask.shape[0]))[seq]
    sampled = old_lp if sampled_lp is None else sampled_lp
    cols = {
        "step": np.full(seq.numel(), step, dtype=np.int32),
        "seq": row.numpy().astype(np.int32),
        "prompt": (row // group_size).numpy().astype(np.int32),
        "sample": (row % group_size).numpy().astype(np.int32),
        "engine": (engine[seq] if engine is not None else torch.zeros_like(seq)).numpy().astype(np.int16),
        "finish": (finish[seq] if finish is not None else torch.zeros_like(seq)).numpy().astype(np.int8),
        "position": pos.numpy().astype(np.int32),
        "token_id": input_ids[seq, pos].numpy().astype(np.int32),
        "version": (
            version[seq, pos].numpy() if version is not None else np.full(seq.numel(), step - 1)
        ).astype(np.int32),
        "pi_train": (
            torch.exp(train_lp[seq, pos]).numpy() if train_lp is not None else np.full(seq.numel(), np.nan)
        ).astype(np.float32),
        "pi_infer": torch.exp(infer_lp[seq, pos]).numpy().astype(np.float32),
        "pi_old": torch.exp(old_lp[seq, pos]).numpy().astype(np.float32),
        "pi_sampled": torch.exp(sampled[seq, pos]).numpy().astype(np.float32),
        "log_ratio_staleness": (old_lp[seq, pos].double() - sampled[seq, pos].double()).numpy(),
        "log_ratio_tim": (sampled[seq, pos].double() - infer_lp[seq, pos].double()).numpy(),
        "log_ratio_total": (old_lp[seq, pos].double() - infer_lp[seq, pos].double()).numpy(),
        "advantage": advantages[seq].numpy().astype(np.float32),
        "reward": rewards[seq].numpy().astype(np.float32),
    }
    table = pa.table(cols)
    if routed is not None:
        r = (
            routed[:, seq, pos - 1].permute(1, 0, 2).reshape(seq.numel(), -1).numpy().astype(np.int16)
        )  # experts that produced the token
        table = table.append_column("routed_experts", pa.array(list(r), type=pa.list_(pa.int16())))
    if root is not None:
        check_inside(root, path, what="token dump")  # before the folder is made: dumps/ may be a link
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    write_atomic(path, buf.getvalue().to_pybytes(), root=root, what="token dump")
    return seq.numel()
