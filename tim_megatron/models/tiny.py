"""The built-in tiny models (Qwen3-MoE by default, any registered family by ``model.dims.family``): a real HF
checkpoint and tokenizer, made offline and deterministically.

``ensure_tiny_checkpoint(dims, ...)`` writes ``config.json``, ``model.safetensors`` (checkpoint layout,
per-expert tensors) and a character-level tokenizer into a cache folder keyed by every input, and returns
the folder. The trainer, the rollout engine, the tests and the demo all load it like any HF model.

The weights get a short supervised warm-up on the *format* of the built-in arithmetic task: after
``a+b=`` comes a number and then the end-of-text token, with the number drawn at random rather than
correct. The model therefore starts RL answering in the right shape, with a success rate of about one in
the number of possible answers, and GRPO has something to improve.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tim_megatron.integrity import IntegrityWarning, sha256_file
from tim_megatron.recipe.schema import ModelDims, TaskConfig
from tim_megatron.untrusted import printable

EOS = "<|endoftext|>"
UNK = "<unk>"
# Characters of the built-in task, of \boxed{} answers and of plain math prose; everything else is <unk>.
CHARS = list("0123456789+-*/=^ ().,?:{}\\\n") + list("abcdefghijklmnopqrstuvwxyz")
VOCAB = [EOS, UNK, *CHARS]
TOKENIZER_VERSION = 1
MANIFEST = "tim_tiny.json"


def cache_root() -> Path:
    return Path(os.environ.get("TIM_CACHE", Path.home() / ".cache" / "tim-megatron"))


def build_tokenizer(vocab_size: int):
    """A character-level fast tokenizer (HF ``PreTrainedTokenizerFast``) padded to ``vocab_size``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(VOCAB):
        raise ValueError(
            f"model.dims.vocab_size = {vocab_size}: the tiny tokenizer needs at least {len(VOCAB)} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    for i in range(len(VOCAB), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=UNK)


def hf_config(dims: ModelDims):
    """The transformers config of a tiny model of ``dims``' family (each family builds its own)."""
    from tim_megatron.trainer.families import get_family

    return get_family(dims.resolved_family).hf_config(dims)


def _key(dims: ModelDims, seed: int, warmup_steps: int, task: TaskConfig) -> str:
    blob = json.dumps(
        {
            "dims": dims.model_dump(),
            "seed": seed,
            "warmup": warmup_steps,
            "task": task.model_dump(),
            "tok": TOKENIZER_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_tiny_checkpoint(
    dims: ModelDims,
    *,
    seed: int = 0,
    warmup_steps: int = 300,
    task: TaskConfig | None = None,
    root: Path | None = None,
) -> Path:
    """Return the folder of the tiny checkpoint for these settings, building it on first use.

    The build records the sha256 of every file it wrote (``tim_tiny.json``); each use verifies them, and a
    cache folder that fails (flipped bits, a truncated or missing file) is rebuilt with a warning.
    """
    task = task or TaskConfig()
    root = Path(root) if root is not None else cache_root() / "tiny"
    target = root / _key(dims, seed, warmup_steps, task)
    root.mkdir(parents=True, exist_ok=True)
    with _cache_lock(root) as holding:  # ranks and test workers at once: one builds, the rest wait
        if target.exists():
            problems = verify_tiny_checkpoint(target)
            if not problems:
                return target
            warnings.warn(
                f"tiny-model cache {target} is corrupt ({'; '.join(problems[:3])}): rebuilding it. "
                f"The cache lives under {root} (TIM_CACHE moves it); delete a folder there to force a rebuild.",
                IntegrityWarning,
                stacklevel=2,
            )
            aside = root / f".corrupt-{target.name}-{os.getpid()}"
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        return _build_atomically(
            root, target, holding=holding, dims=dims, seed=seed, warmup_steps=warmup_steps, task=task
        )


def _checksums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify_tiny_checkpoint(folder: Path) -> list[str]:
    """What is wrong with a cached tiny checkpoint (empty: every file as built)."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["sha256"]
        if not isinstance(recorded, dict):
            raise TypeError("no file table")
    except FileNotFoundError:
        return [f"{MANIFEST} is missing"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST} has no checksums ({type(e).__name__}: {e}); built by an older version?"]
    problems = [f"{n}: missing" for n in ("config.json", "model.safetensors") if n not in recorded]
    actual = _checksums(folder)
    for name, digest in recorded.items():
        if name not in actual:
            problems.append(f"{name}: missing")
        elif actual[name] != digest:
            problems.append(f"{name}: sha256 mismatch")
    return problems


@contextlib.contextmanager
def _cache_lock(root: Path):
    """The cache's lock, held while a checkpoint is checked or built. A process that has to wait says so once, with
    what the holder wrote into the lock (its pid and what it builds), instead of waiting in silence."""
    path = root / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode("utf-8", "replace").strip() or "another process"
            print(f"tiny model: waiting for the cache lock {path} (held by {printable(holder)})", flush=True)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            print(f"tiny model: the cache lock came free after {time.monotonic() - t0:.0f} s", flush=True)

        def holding(what: str) -> None:  # what a process waiting on the lock is told
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{what}".encode(), 0)

        holding("")
        yield holding
    finally:
        os.close(fd)  # releases the lock


def _build_atomically(root: Path, target: Path, *, holding, **kw) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        holding(f", building {target.name} ({kw['warmup_steps']} warm-up steps)")
        print(f"tiny model: building {target} ({kw['warmup_steps']} warm-up steps of the format)", flush=True)
        t0 = time.monotonic()
        _build(tmp, **kw)
        print(f"tiny model: built in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            os.replace(tmp, target)  # atomic: a concurrent builder loses the race harmlessly
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(folder: Path, *, dims: ModelDims, seed: int, warmup_steps: int, task: TaskConfig) -> None:
    from transformers import AutoModelForCausalLM

    cfg = hf_config(dims)
    tokenizer = build_tokenizer(dims.vocab_size)
    threads = torch.get_num_threads()
    # One thread: the warm-up's float sums then run in one order whatever OMP_NUM_THREADS says, so a
    # checkpoint built by a 2-thread `tim train` equals one built by a 1-thread test worker.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            _family_init(model, dims, seed)
            if warmup_steps:
                _warmup(model, tokenizer, steps=warmup_steps, seed=seed, task=task)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    meta = {
        "built_by": "tim_megatron.models.tiny",
        "seed": seed,
        "warmup_steps": warmup_steps,
        "task": task.model_dump(),
        "sha256": _checksums(folder),
    }
    (folder / MANIFEST).write_text(json.dumps(meta, indent=2))


def _family_init(model, dims: ModelDims, seed: int) -> None:
    from tim_megatron.trainer.families import get_family

    init = get_family(dims.resolved_family).tiny_init
    if init is not None:
        init(model, seed)


def _warmup(model, tokenizer, *, steps: int, seed: int, task: TaskConfig) -> None:
    from tim_megatron.data.tasks import format_warmup_batch

    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        ids, labels = format_warmup_batch(tokenizer=tokenizer, task=task, batch_size=32, generator=g)
        out = model(input_ids=ids, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
