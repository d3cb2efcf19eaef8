"""The exact sampler's KV cache: one fixed-width key/value buffer per attention layer and sequence, read in place.

Every buffer is as wide as the training forward the old-logprob pass will run (``MegatronTrainer.exact_width``),
so a cached query attends over exactly the keys, at exactly the width, that the training forward's causal row
holds: the positions after it are masked out in both (zeros here, later tokens there), and the softmax and the
probabilities-times-values product reduce over the same ``W`` entries.

Layout ``[slots, groups, width, head_dim]`` per layer. A sequence lives in a slot; the live sequences always fill
slots ``0 .. live - 1``: when one finishes (:meth:`KVCache.release`), the sequence in the last live slot moves into
its slot (one row's buffers copied, once per finished sequence). The slots ``lo .. hi`` of a step's sequences are
then one contiguous block of about as many slots as sequences, and viewed as ``[(hi - lo + 1) x groups, width,
head_dim]`` they are the batch of attention's products without a copy (:meth:`KVCache.span`). A row's bits do not
depend on its slot: each batch element of the products is computed on its own. The buffers hold the keys and values in the model's dtype, as the training forward
holds them (bfloat16 for a bfloat16 model): the tiles widen their operands to float32 on every read, which gives
the value a float32 cache would have held, so the bits are the same at half the bytes. Padding entries (the ones that keep decode shapes equal across ranks) carry the row
index :attr:`KVCache.scratch`: they are never written and never attend, so they cost neither memory nor depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    rows: int
    """Sequences this rank generates (one slot each)."""
    width: int
    """Positions per row: the training forward's width."""
    dtype: torch.dtype | None = None
    """Storage dtype (the model's); None: the dtype of the first keys written."""
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per attention layer: ``[rows, groups, width, head_dim]``, allocated on the layer's first write."""
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    read_bytes: int = 0
    """Bytes of keys and values handed to decode steps (as views: read in place by the attention products)."""
    copied_bytes: int = 0
    """Bytes of keys and values copied: a finished sequence's slot refilled from the last live slot."""

    slot: torch.Tensor = field(init=False)
    """``[rows + 1]``: each sequence's slot (-1 once released; entry ``rows``, the padding entries', is -1)."""
    owner: list[int] = field(init=False)
    """Each slot's sequence."""
    live: int = field(init=False)
    """Slots in use: ``0 .. live - 1``."""

    def __post_init__(self):
        self.slot = torch.cat([torch.arange(self.rows), torch.tensor([-1])])
        self.owner = list(range(self.rows))
        self.live = self.rows

    @property
    def scratch(self) -> int:
        """The row index of padding entries: never stored, never read."""
        return self.rows

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """The slots of sequences ``rows`` (-1: padding or released)."""
        return self.slot.to(rows.device)[rows]

    def release(self, row: int) -> None:
        """Sequence ``row`` is done: the last live slot's sequence moves into its slot."""
        s, last = int(self.slot[row]), self.live - 1
        if s < 0:
            raise ValueError(f"KV cache: sequence {row} released twice")
        if s != last:
            for d in (self.keys, self.values):
                for t in d.values():
                    t[s] = t[last]
                    self.copied_bytes += t[s].numel() * t.element_size()
            moved = self.owner[last]
            self.slot[moved], self.owner[s] = s, moved
        self.slot[row] = -1
        self.live -= 1

    def write(
        self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """Store the entries' keys and values ``[n, groups, head_dim]`` at sequence ``rows[i]``, position
        ``positions[i]``; padding entries (row :attr:`scratch`) are skipped."""
        slots = self.slots(rows)
        real = slots >= 0
        if not bool(real.any()):
            return
        slots, positions, k, v = slots[real], positions[real], k[real], v[real]
        if int(positions.max()) >= self.width or int(positions.min()) < 0:
            raise ValueError(
                f"KV cache: position {int(positions.max())} outside the buffer width {self.width}"
            )
        if layer not in self.keys:
            dtype = self.dtype or k.dtype
            shape = (max(self.rows, 1), k.shape[1], self.width, k.shape[2])
            self.keys[layer] = torch.zeros(shape, dtype=dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=dtype, device=v.device)
        keys, values = self.keys[layer], self.values[layer]
        keys[slots, :, positions] = k.to(keys.dtype)
        values[slots, :, positions] = v.to(values.dtype)

    def span(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``lo .. hi`` (inclusive) as views ``[(hi - lo + 1) x groups, width, head_dim]``: no copy."""
        keys, values = self.keys[layer][lo : hi + 1], self.values[layer][lo : hi + 1]
        self.read_bytes += 2 * keys.numel() * keys.element_size()
        flat = (-1, self.width, keys.shape[-1])
        return keys.view(flat), values.view(flat)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())


def cache_bytes(*, rows: int, width: int, layers: int, groups: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of the exact sampler's cache: keys and values of ``rows`` sequences at ``width`` positions."""
    return 2 * layers * rows * groups * width * head_dim * dtype_bytes
