"""Generic HF <-> megatron-core conversion driven by each family's weight table (rule format: :mod:`.mapping`).

* :func:`load_hf_into_model`: reads HF safetensors (one file or several) and copies into each rank's slices,
  TP/ETP/EP aware. Every model parameter must be covered, every needed HF tensor must exist with the
  expected shape; anything else is an error that names the tensor and both shapes.
* :func:`export_hf`: yields ``(hf_name, tensor)`` in HF checkpoint names and shapes (per-expert tensors, or the
  experts stacked into one tensor where the checkpoint stacks them: gpt-oss),
  gathering slices over TP/ETP and experts over EP, one parameter at a time so peak extra memory is one
  full parameter. Every rank takes part in the collectives and receives every tensor.

Both read and write the grouped path's stacked expert weights through per-expert views (one expert's slice of the
stack, no copy) under the loop's parameter names, so the tables and everything here see one layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.weights import fp8, mxfp4
from tim_megatron.trainer.weights.mapping import Rule, canonical_name
from tim_megatron.trainer.weights.model_files import (
    INDEX,
    WeightLoadError,
    model_file,
    read_index,
    safetensors_names,
)

# --------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: object = None
    etp_group: object = None
    ep_group: object = None

    @classmethod
    def current(cls) -> Layout:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
        )


def _match(table: tuple[Rule, ...], name: str) -> tuple[Rule, dict[str, int]] | None:
    for rule in table:
        m = rule.pattern().match(name)
        if m:
            return rule, {k: int(v) for k, v in m.groupdict().items()}
    return None


def _hf_names(rule: Rule, idx: dict[str, int]) -> list[str]:
    return [n.replace("{L}", str(idx.get("L", ""))).replace("{E}", str(idx.get("E", ""))) for n in rule.hf]


# ------------------------------------------------------------------------------------------ HF reading


class HFCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint folder. A block-FP8 checkpoint (DeepSeek-V3,
    Kimi-K2; :mod:`.fp8`) reads as its dequantized float32 weights: its ``_scale_inv`` tensors are consumed by
    :meth:`get` and are not among :meth:`keys`; an MXFP4 one (gpt-oss; :mod:`.mxfp4`) alike, its ``_blocks`` and
    ``_scales`` read as the weight they encode. Its files are read under :mod:`.model_files`' rule (regular files
    of the folder, shards named inside it, lengths checked before a shard is opened)."""

    def __init__(self, folder: str | Path):
        from tim_megatron.trainer.hf_config import read_hf_config

        self.folder = Path(folder)
        config = model_file(self.folder, "config.json", what="config", missing_ok=True)
        cfg = read_hf_config(config) if config else {}
        self.mxfp4 = mxfp4.is_mxfp4(cfg)
        """An MXFP4 checkpoint (gpt-oss; :mod:`.mxfp4`): read as its dequantized weights."""
        self.fp8: fp8.BlockFP8 | None = (
            fp8.block_fp8_of(cfg, where=str(self.folder / "config.json"))
            if config and not self.mxfp4
            else None
        )
        """The checkpoint's block-FP8 format, None when it is not quantized."""
        self._names: dict[str, set[str]] = {}
        """Per checked shard, the tensors its header lists."""
        self._paths: dict[str, Path] = {}
        index = model_file(self.folder, INDEX, what="index", missing_ok=True)
        if index is not None:
            weight_map = read_index(self.folder, index)
        elif model_file(self.folder, "model.safetensors", what="weights file", missing_ok=True) is not None:
            weight_map = dict.fromkeys(sorted(self._check("model.safetensors")), "model.safetensors")
        else:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors or {INDEX}")
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, object] = {}

    def _check(self, fname: str) -> set[str]:
        """The tensors of shard ``fname``, once it is found readable and its lengths fit its size."""
        if fname not in self._names:
            path = model_file(self.folder, fname, what="shard")
            self._names[fname] = safetensors_names(path, shown=self.folder / fname)
            self._paths[fname] = path
        return self._names[fname]

    def check_files(self) -> None:
        """Check every shard the checkpoint names (before a long job reads them one by one)."""
        for fname in sorted(set(self.weight_map.values())):
            self._check(fname)

    def keys(self) -> set[str]:
        if self.mxfp4:
            return mxfp4.logical_names(self.weight_map)
        if self.fp8 is None:
            return set(self.weight_map)
        return {k for k in self.weight_map if not k.endswith(fp8.SCALE_SUFFIX)}

    def quantized(self, name: str) -> bool:
        """Whether tensor ``name`` (one of :meth:`keys`) is stored quantized (read dequantized)."""
        if self.mxfp4:
            return name not in self.weight_map and name + mxfp4.BLOCKS_SUFFIX in self.weight_map
        return self.fp8 is not None and name + fp8.SCALE_SUFFIX in self.weight_map

    def shard_of(self, name: str) -> str:
        """The shard file holding tensor ``name`` (one of :meth:`keys`; an MXFP4 weight: its codes')."""
        return self.weight_map[name + mxfp4.BLOCKS_SUFFIX if self.mxfp4 and self.quantized(name) else name]

    def _mxfp4(self, name: str, expert: int | None = None) -> torch.Tensor:
        """An MXFP4 weight dequantized (to float32), whole or one expert's slice."""
        pair = []
        for suffix in (mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX):
            if name + suffix not in self.weight_map:
                raise WeightLoadError(
                    f"{self.folder}: MXFP4 tensor {name!r} has no {name + suffix!r} (allowed: both "
                    f"{mxfp4.BLOCKS_SUFFIX} and {mxfp4.SCALES_SUFFIX}, as gpt-oss publishes them)"
                )
            pair.append(self._raw(name + suffix) if expert is None else self._slice(name + suffix, expert))
        try:
            return mxfp4.dequantize(*pair, name=name, dtype=torch.float32)
        except ValueError as e:
            raise WeightLoadError(f"{self.folder}: {e}") from None

    def _raw(self, name: str, *, slice_only: bool = False) -> torch.Tensor | None:
        """Tensor ``name`` as stored (``slice_only``: only check and open its shard, read nothing)."""
        from safetensors import SafetensorError, safe_open

        fname = self.weight_map.get(name)
        if fname is None:
            raise WeightLoadError(
                f"{self.folder}: tensor {name!r} is missing from the checkpoint (is it for another model?)"
            )
        if name not in self._check(fname):
            raise WeightLoadError(
                f"{self.folder / INDEX}: tensor {name!r} is in shard {fname}, which lacks it"
            )
        try:
            if fname not in self._open:
                self._open[fname] = safe_open(self._paths[fname], "pt")
            return None if slice_only else self._open[fname].get_tensor(name)
        except SafetensorError as e:
            raise WeightLoadError(f"{self.folder / fname}: tensor {name!r} cannot be read: {e}") from None

    def get_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s slice of a tensor that stacks every expert along its first dimension (gpt-oss's fused
        expert tensors), read alone rather than with the whole tensor."""
        if self.mxfp4 and self.quantized(name):
            return self._mxfp4(name, expert)
        return self._slice(name, expert)

    def _slice(self, name: str, index: int) -> torch.Tensor:
        from safetensors import SafetensorError

        self._raw(name, slice_only=True)  # the shard's checks and its opening, as for a whole tensor
        try:
            part = self._open[self.weight_map[name]].get_slice(name)
            count = part.get_shape()[0] if part.get_shape() else 0
            if not 0 <= index < count:
                raise WeightLoadError(
                    f"{self.folder}: tensor {name!r} stacks {count} experts; expert {index} is not among them (is "
                    "the checkpoint for another model?)"
                )
            return part[index]
        except SafetensorError as e:
            raise WeightLoadError(f"{self.folder}: tensor {name!r} cannot be read: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        if self.mxfp4 and self.quantized(name):
            return self._mxfp4(name)
        t = self._raw(name)
        if t.dtype != torch.float8_e4m3fn:
            return t
        if self.fp8 is None or name + fp8.SCALE_SUFFIX not in self.weight_map:
            raise WeightLoadError(
                f"{self.folder}: tensor {name!r} is float8_e4m3fn but "
                + (
                    "config.json has no quantization_config"
                    if self.fp8 is None
                    else f"its scales {name + fp8.SCALE_SUFFIX!r} are missing"
                )
                + " (allowed: block-FP8 weights with their _scale_inv, as DeepSeek-V3 publishes them)"
            )
        try:
            return fp8.dequantize(t, self._raw(name + fp8.SCALE_SUFFIX), self.fp8.block, name=name)
        except ValueError as e:
            raise WeightLoadError(f"{self.folder}: {e}") from None


# ----------------------------------------------------------------------------------- combine / split


def _combine(rule: Rule, parts: list[torch.Tensor], dims: ModelDims) -> torch.Tensor:
    """HF tensors -> the full (unsplit) megatron tensor."""
    if rule.combine == "copy":
        return parts[0]
    if rule.combine == "gate_up":
        return torch.cat(parts, 0)
    if rule.combine == "interleaved_gate_up":
        w = (
            parts[0] if parts[0].dim() == 1 else parts[0].t()
        )  # [2 x width(, hidden)], gate and up alternating
        return torch.cat([w[0::2], w[1::2]], 0)
    if rule.combine == "transpose":
        return parts[0] if parts[0].dim() == 1 else parts[0].t()
    if rule.combine == "qkv":
        q, k, v = (p if p.dim() == 2 else p.unsqueeze(-1) for p in parts)  # weights [rows, h], biases [rows]
        g, d, h = dims.num_key_value_heads, dims.head_dim, q.shape[-1]
        qpg = dims.num_attention_heads // g
        full = torch.cat([q.view(g, qpg * d, h), k.view(g, d, h), v.view(g, d, h)], 1).reshape(-1, h)
        return full if parts[0].dim() == 2 else full.squeeze(-1)
    raise ValueError(rule.combine)


def _uncombine(rule: Rule, full: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
    if rule.combine == "copy":
        return [full]
    if rule.combine == "gate_up":
        return list(full.chunk(2, 0))
    if rule.combine == "interleaved_gate_up":
        gate, up = full.chunk(2, 0)
        w = torch.stack([gate, up], 1).reshape(full.shape)  # rows gate 0, up 0, gate 1, ...
        return [w if w.dim() == 1 else w.t()]
    if rule.combine == "transpose":
        return [full if full.dim() == 1 else full.t()]
    if rule.combine == "qkv":
        g, d = dims.num_key_value_heads, dims.head_dim
        qpg = dims.num_attention_heads // g
        vec = full.dim() == 1
        x = full.unsqueeze(-1) if vec else full
        h = x.shape[-1]
        q, k, v = x.view(g, (qpg + 2) * d, h).split([qpg * d, d, d], 1)
        parts = [q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]
        return [p.squeeze(-1) for p in parts] if vec else parts
    raise ValueError(rule.combine)


def _ranks(rule: Rule, lay: Layout) -> tuple[int, int]:
    return (lay.etp_rank, lay.etp_size) if rule.split.startswith("e") else (lay.tp_rank, lay.tp_size)


def _rank_slice(rule: Rule, full: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The full megatron tensor -> this rank's slice."""
    rank, size = _ranks(rule, lay)
    s = rule.split
    if s == "rep" or size == 1:
        return full
    if s in ("tp0", "etp0", "qkv"):
        return full.chunk(size, 0)[rank]
    if s in ("tp1", "etp1"):
        return full.chunk(size, 1)[rank]
    if s in ("gate_up", "egate_up"):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    raise ValueError(s)


def _join_slices(rule: Rule, slices: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' slices -> the full megatron tensor."""
    s = rule.split
    if len(slices) == 1 or s == "rep":
        return slices[0]
    if s in ("tp0", "etp0", "qkv"):
        return torch.cat(slices, 0)
    if s in ("tp1", "etp1"):
        return torch.cat(slices, 1)
    if s in ("gate_up", "egate_up"):
        halves = [sh.chunk(2, 0) for sh in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    raise ValueError(s)


def _local_to_global_expert(idx: dict[str, int], dims: ModelDims, lay: Layout) -> dict[str, int]:
    if "E" not in idx:
        return idx
    per_rank = dims.num_experts // lay.ep_size
    return {**idx, "E": lay.ep_rank * per_rank + idx["E"]}


# ------------------------------------------------------------------------------------------------ load


def _named_params(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, the grouped path's stacked expert weights as per-expert views under the loop's names
    (:func:`~tim_megatron.trainer.experts.per_expert_parameters`): the weight tables name experts one by one."""
    from tim_megatron.trainer.experts import per_expert_parameters
    from tim_megatron.trainer.model import unwrap

    yield from per_expert_parameters(unwrap(model))


def _named_tensors(model, table: tuple[Rule, ...]) -> Iterator[tuple[str, torch.Tensor, Rule | None, dict]]:
    """Every parameter, then every buffer a buffer rule names, each with its rule and indices (None if none)."""
    from tim_megatron.trainer.model import unwrap

    for name, p in _named_params(model):
        hit = _match(table, canonical_name(name))
        yield (name, p, *hit) if hit else (name, p, None, {})
    buffer_rules = tuple(r for r in table if r.buffer)
    if buffer_rules:
        for name, b in unwrap(model).named_buffers():
            hit = _match(buffer_rules, name)
            if hit:
                yield (name, b, *hit)


def _table(family: str) -> tuple[Rule, ...]:
    from tim_megatron.trainer.families import get_family

    return get_family(family).weights


def load_hf_into_model(
    model, folder: str | Path, *, family: str, dims: ModelDims, layout: Layout | None = None
) -> int:
    """Copy an HF checkpoint into this rank's parameters (and named buffers). Returns how many were loaded."""
    from tim_megatron.trainer.families import get_family

    lay = layout or Layout.current()
    fam = get_family(family)
    table = fam.weights
    ckpt = HFCheckpoint(folder)
    used: set[str] = set()
    n = 0
    for name, param, rule, idx in _named_tensors(model, table):
        if rule is None:
            raise WeightLoadError(
                f"megatron parameter {name!r} is not covered by the {family} weight table "
                f"(tim_megatron/trainer/families/{family}.py)"
            )
        gidx = _local_to_global_expert(idx, dims, lay)
        names = _hf_names(rule, gidx)
        parts = [ckpt.get_expert(h, gidx["E"]) if rule.stacked_experts else ckpt.get(h) for h in names]
        used.update(names)
        try:
            full = _combine(rule, parts, dims)
        except RuntimeError as e:
            shapes = ", ".join(f"{h} {tuple(p.shape)}" for h, p in zip(names, parts, strict=True))
            raise WeightLoadError(
                f"{folder}: cannot assemble {name!r} from {shapes}: {e} (is the checkpoint for another model?)"
            ) from None
        mine = _rank_slice(rule, full, lay)
        if tuple(mine.shape) != tuple(param.shape):
            raise WeightLoadError(
                f"{folder}: {', '.join(names)} gives {name!r} the shape {tuple(mine.shape)} on this rank, but the model "
                f"expects {tuple(param.shape)} (is the checkpoint for another model?)"
            )
        with torch.no_grad():
            if (
                rule.buffer
            ):  # kept in the checkpoint's precision (megatron keeps an expert bias in fp32 under bf16)
                param.data = mine.to(param.device).clone()
            else:
                param.copy_(mine.to(param.dtype))
        n += 1
    expected_unused = ({"lm_head.weight"} & ckpt.keys()) if dims.tie_word_embeddings else set()
    expected_unused |= {k for k in ckpt.weight_map if fam.ignored_hf(k, dims)}
    if lay.ep_size == 1:
        stray = ckpt.keys() - used - expected_unused
        if stray:
            raise WeightLoadError(
                f"{folder}: {len(stray)} tensor(s) not used by the model, e.g. {sorted(stray)[:3]} (is it for another model?)"
            )
    return n


# ---------------------------------------------------------------------------------------------- export


def _gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _param_full(rule: Rule, param: torch.Tensor, lay: Layout, grads: bool = False) -> torch.Tensor:
    t = _grad_of(param) if grads else param.detach()
    if rule.split == "rep":
        return t
    grp, size = (lay.etp_group, lay.etp_size) if rule.split.startswith("e") else (lay.tp_group, lay.tp_size)
    return _join_slices(rule, _gather(t, grp, size))


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    g = getattr(param, "main_grad", None)
    if g is None:
        g = param.grad
    return torch.zeros_like(param, dtype=torch.float32) if g is None else g.detach().float()


def export_hf(
    model,
    *,
    family: str,
    dims: ModelDims,
    layout: Layout | None = None,
    dtype: torch.dtype | None = None,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF checkpoint tensor of the model (in order, on every rank); ``grads``: the parameters'
    gradients (buffers, which are never trained, are left out)."""
    lay = layout or Layout.current()
    table = _table(family)
    params = dict(_named_params(model))
    per_rank = dims.num_experts // lay.ep_size if dims.is_moe else 0
    for name, param, rule, idx in _named_tensors(model, table):
        if rule is None:
            raise WeightLoadError(f"megatron parameter {name!r} is not covered by the {family} weight table")
        if rule.buffer and grads:
            continue
        if "E" not in idx:
            full = _param_full(rule, param, lay, grads)
            for hf, t in zip(_hf_names(rule, idx), _uncombine(rule, full, dims), strict=True):
                yield hf, (t if dtype is None else t.to(dtype))
            continue
        if idx["E"] != 0:
            continue  # experts are exported from local expert 0's visit, for every global expert
        stacks: dict[str, list[torch.Tensor]] = {}  # rule.stacked_experts: every expert's, stacked at the end
        for g in range(dims.num_experts):
            owner, local = divmod(g, per_rank)
            local_name = name.replace(f"local_experts.{idx['E']}.", f"local_experts.{local}.", 1)
            mine = params[local_name]
            full = _param_full(rule, mine, lay, grads)
            if lay.ep_size > 1:
                buf = full.contiguous() if owner == lay.ep_rank else torch.empty_like(full)
                dist.broadcast(buf, src=dist.get_global_rank(lay.ep_group, owner), group=lay.ep_group)
                full = buf
            for hf, t in zip(_hf_names(rule, {**idx, "E": g}), _uncombine(rule, full, dims), strict=True):
                t = t if dtype is None else t.to(dtype)
                if rule.stacked_experts:
                    stacks.setdefault(hf, []).append(t)
                else:
                    yield hf, t
        for hf, ts in stacks.items():
            yield hf, torch.stack(ts)
