"""The models ``make gpu-check`` runs: the built-in tiny MoE and a ~1B-parameter Qwen3-MoE-shaped model with
random weights, each as a real HF checkpoint; their HF transformers logprobs; and the recipe that points the
trainer at them."""

from __future__ import annotations

from pathlib import Path

import torch

from tim_megatron.recipe.schema import ModelDims, Recipe

ROOT = Path(__file__).resolve().parents[2]
BASE_RECIPE = ROOT / "recipes" / "tiny-moe" / "base.yaml"


def qwen3_moe_1b_dims() -> ModelDims:
    """Qwen3-30B-A3B's shape scaled to about 1B parameters (0.98B, 0.53B active per token).

    Kept from Qwen3-30B-A3B: head_dim 128, 4 query heads per KV head, top-8 routing with renormalized
    weights, no shared expert, every layer MoE, the 151,936-token vocabulary and untied embeddings (so the
    LM head and its logsumexp are full size). Scaled down: width 1024, 12 layers, 32 experts of width 512.
    """
    return ModelDims(
        hidden_size=1024,
        num_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        intermediate_size=3072,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def random_checkpoint(dims: ModelDims, folder: Path, *, seed: int = 0, device: str = "cpu") -> Path:
    """An HF checkpoint of ``dims`` with random weights stored in bfloat16 (so every engine, in any dtype,
    starts from exactly the same numbers). Reused when already written."""
    from transformers import AutoModelForCausalLM

    from tim_megatron.models.tiny import hf_config

    folder = Path(folder)
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    cfg = hf_config(dims)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tmp.replace(folder)
    return folder


def probe_batch(*, vocab: int, n: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` right-padded sequences of random tokens, of lengths from ``length`` down to about half of it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    lengths = torch.linspace(length, max(length // 2, 2), n).round().long()
    for i, k in enumerate(lengths):
        ids[i, k:] = 0
    return ids, lengths


def next_token_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """``[n, length - 1]``: True where position t + 1 is a real token (the logprob of token t + 1 given <= t)."""
    return torch.arange(1, length)[None, :] < lengths[:, None]


@torch.no_grad()
def hf_logprobs(path: Path, ids: torch.Tensor, *, dtype: torch.dtype, device: str) -> torch.Tensor:
    """HF transformers' logprob of each next token, ``[n, length - 1]``, computed in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        out = []
        for row in ids.split(4):
            x = row.to(device)
            logp = torch.log_softmax(model(input_ids=x).logits.float(), -1)
            out.append(logp[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1).cpu())
        return torch.cat(out)
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


@torch.no_grad()
def hf_router_topk(path: Path, ids: torch.Tensor, *, k: int, device: str) -> torch.Tensor:
    """HF transformers' (float32) top-k experts per token and layer, ``[n, length, layers, k]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    try:
        out = model(input_ids=ids.to(device), output_router_logits=True)
        n, length = ids.shape
        per_layer = [r.view(n, length, -1).topk(k, -1).indices.cpu() for r in out.router_logits]
        return torch.stack(per_layer, 2)
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def recipe_for(
    path: Path | str,
    dims: ModelDims | None,
    *,
    dtype: str,
    micro_batch: int,
    max_model_len: int,
    gpus: int,
    gpu_type: str | None = None,
    overrides: tuple[str, ...] = (),
) -> Recipe:
    """A one-process recipe for the checkpoint at ``path`` (``tiny``: the built-in model, ``dims`` unused), with
    ``overrides`` (``key=value``) last."""
    from tim_megatron.recipe import load_recipe

    over = [
        f"model.path={path}",
        f"trainer.dtype={dtype}",
        f"rollout.dtype={dtype}",
        f"trainer.micro_batch_size={micro_batch}",
        f"rollout.max_model_len={max_model_len}",
        f"cluster.gpus_per_node={gpus}",
        "logging.wandb.mode=disabled",
    ]
    if gpu_type:
        over.append(f"cluster.gpu_type={gpu_type}")
    if str(path) != "tiny" and dims is not None:
        for key, value in dims.model_dump(exclude_none=True).items():
            over.append(f"model.dims.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return load_recipe(BASE_RECIPE, [*over, *overrides]).recipe


def gpu_type_key(name: str, total_bytes: int) -> str | None:
    """``tim plan``'s key for a GPU model (``NVIDIA H200`` with 141 GB -> ``h200-141gb``), when it has one."""
    from tim_megatron.slurm.plan import GPU_MEMORY_GIB

    lowered = name.lower()
    gib = total_bytes / 2**30
    best = None
    for key, size in GPU_MEMORY_GIB.items():
        model = key.split("-")[0]
        if size and model in lowered and (best is None or abs(size - gib) < abs(GPU_MEMORY_GIB[best] - gib)):
            best = key
    return best
