"""The exact sampler's KV cache: one fixed-width key/value buffer per attention layer and sequence.

Every buffer is as wide as the training forward the old-logprob pass will run (``MegatronTrainer.exact_width``),
so a cached query attends over exactly the keys, at exactly the width, that the training forward's causal row
holds: the positions after it are masked out in both (zeros here, later tokens there), and the softmax and the
probabilities-times-values product reduce over the same ``W`` entries. One extra row (index ``rows``) takes the
padding entries that keep decode shapes equal across ranks; it is never read for a real sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    rows: int
    """Sequences (cache rows) this rank generates; row ``rows`` is the padding entries' scratch row."""
    width: int
    """Positions per row: the training forward's width."""
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per attention layer: ``[rows + 1, width, groups, head_dim]``, allocated on the layer's first write."""
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def scratch(self) -> int:
        return self.rows

    def write(
        self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """Store the new entries' keys and values ``[n, groups, head_dim]`` at ``(rows[i], positions[i])``."""
        if int(positions.max()) >= self.width or int(positions.min()) < 0:
            raise ValueError(
                f"KV cache: position {int(positions.max())} outside the buffer width {self.width}"
            )
        if layer not in self.keys:
            shape = (self.rows + 1, self.width, *k.shape[1:])
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.keys[layer][rows, positions] = k
        self.values[layer][rows, positions] = v

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffers of ``rows``: keys and values ``[n, width, groups, head_dim]``."""
        return self.keys[layer][rows], self.values[layer][rows]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())
