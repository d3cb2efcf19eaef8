"""``make new-recipe``: a recipe folder for another HF model, copied from an existing one.

The new folder's ``base.yaml`` is a short diff over the source folder's ``base.yaml``: the model path, its
dimensions read from ``config.json`` by its family (:mod:`tim_megatron.trainer.families`), and the layout
:func:`tim_megatron.slurm.plan.choose_layout` finds for the source's GPU type: TP, EP, the node count (scaled up
when the source's does not fit), vLLM's tensor-parallel size and memory share. The header says what was tried
and why it did not fit. The variant files (the source folder's other YAML files, which inherit from ``base.yaml``
in their own folder) are copied as they are where the new model runs them; where it does not, a variant's own
lengths are fitted as ``base.yaml``'s are (``rollout.max_model_len`` to the model's positions, ``rollout.max_tokens``
to what the prompts leave), and a variant that still does not validate (e.g. exact mode for a model with
multi-head latent attention) is left out, with a line saying why, printed and in ``base.yaml``'s header.
Everything written is validated before the folder appears; an existing folder is never overwritten.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.dims import FEATURES
from tim_megatron.recipe.loader import MAX_YAML_BYTES, LoadedRecipe, yaml_load
from tim_megatron.safe_files import UnsafePathError, copy_regular, read_text, write_atomic
from tim_megatron.trainer.hf_config import UnsupportedModelError, dims_from_hf, read_hf_config


def new_recipe(
    src: str | Path,
    name: str,
    hf: str | Path,
    *,
    recipes_root: str | Path = "recipes",
    min_nodes: int | None = None,
    say: Callable[[str], None] | None = print,
) -> tuple[Path, list[str]]:
    """Write ``recipes_root/name`` from ``src`` for the model of ``hf`` (its dims, a layout that fits). The layout
    search starts at ``min_nodes`` nodes (default: the source recipe's) and doubles. Returns the folder and the
    files written; ``say`` gets one line per variant fitted or left out, once the folder is in place."""
    from tim_megatron.slurm.plan import choose_layout

    src = Path(src)
    root = Path(recipes_root)
    if not root.is_dir():
        raise RecipeError(
            f"--recipes-root = {str(root)!r}: no such folder; allowed: an existing folder of recipe folders "
            "(fix: create it, or leave it unset for recipes/)"
        )
    if not (src / "base.yaml").is_file():
        raise RecipeError(
            f"FROM={src}: not a recipe folder (no base.yaml); allowed: a folder like recipes/qwen3-30b-a3b"
        )
    if min_nodes is not None and min_nodes < 1:
        raise RecipeError(
            f"NODES={min_nodes}: allowed: an integer >= 1 (the smallest cluster the search tries)"
        )
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,63}", name):
        raise RecipeError(
            f"NAME={name!r}: allowed: lowercase letters, digits, '.' and '-', starting with a letter or digit"
        )
    dest = root / name
    if dest.is_symlink() and not dest.exists():
        raise RecipeError(
            f"NAME={name!r}: {dest} is a link to {str(dest.readlink())!r}, which does not exist; allowed: a name "
            "that is free under the recipes folder (pick another NAME or remove the link)"
        )
    if dest.exists():
        raise RecipeError(
            f"{dest} already exists; refusing to overwrite it (pick another NAME or delete it first)"
        )
    hf = Path(hf)
    try:
        dims = dims_from_hf(read_hf_config(hf))
    except UnsupportedModelError as e:  # a bad config.json included: each names the key, value and fix
        raise RecipeError(f"HF={hf}: {e}") from None
    model_path = str(hf.parent if hf.name == "config.json" and hf.is_file() else hf)
    rel = (
        Path("..") / src.resolve().relative_to(root.resolve()) / "base.yaml"
        if src.resolve().is_relative_to(root.resolve())
        else (src / "base.yaml").resolve()
    )
    diff: dict = {
        "base": str(rel),
        "model": {"path": model_path, "dims": written_dims(dims)},
        "logging": {"wandb": {"project": f"tim-megatron-{name}"}},
    }
    source = load_recipe(src / "base.yaml").recipe
    rollout, notes = _fit_context(source, dims.max_position_embeddings)
    # Staged beside the destination (the base: path is relative to it), validated, then copied into place.
    with tempfile.TemporaryDirectory(prefix=f"{name}.new-", dir=root) as tmp:
        t = Path(tmp)
        left: dict[str, str] = {}
        for f in sorted(src.glob("*.yaml")):
            if f.name != "base.yaml":
                try:  # a link, a FIFO or a device named *.yaml is not copied (nor read)
                    copy_regular(src / f.name, t / f.name, src_root=src, dst_root=t, max_bytes=MAX_YAML_BYTES)
                except UnsafePathError as e:
                    left[f.name] = f"not copied: {e}"
                except OSError as e:
                    left[f.name] = f"not copied: {f} cannot be read ({e.strerror})"
        if rollout:
            diff["rollout"] = dict(rollout)
        _write(t / "base.yaml", src, hf, diff, notes)
        # Search the layout with the new dimensions (from the source's cluster size up), then write it.
        probe = load_recipe(t / "base.yaml", _single_gpu_layout(t))
        choice = choose_layout(probe.recipe, min_nodes=min_nodes)
        per_node = max(probe.recipe.cluster.gpus_per_node, 1)
        world = choice.nodes * per_node
        diff["parallel"] = {
            "tp": choice.tp,
            "ep": choice.ep,
            "dp": world // choice.tp,
            "expert_tp": _expert_tp(choice.tp, choice.ep, source.parallel.expert_tp),
        }
        if choice.nodes != probe.recipe.cluster.nodes:
            diff["cluster"] = {"nodes": choice.nodes}
        if choice.rollout_tp != probe.recipe.rollout.tensor_parallel_size:
            rollout["tensor_parallel_size"] = choice.rollout_tp
        if choice.offload != probe.recipe.trainer.offload_during_rollout:
            diff["trainer"] = {"offload_during_rollout": choice.offload}
        if choice.gpu_memory_utilization != probe.recipe.rollout.gpu_memory_utilization:
            rollout["gpu_memory_utilization"] = choice.gpu_memory_utilization
        if rollout:
            diff["rollout"] = rollout
        notes += [f"did not fit: {line}" for line in choice.tried]
        if not choice.fits:
            notes.append("NOTHING FITS up to the largest cluster tried: this is the smallest plan found.")
        _write(t / "base.yaml", src, hf, diff, notes)
        fitted = _fit_variants(t, src, dims.max_position_embeddings, left)
        for f in sorted(t.glob("*.yaml")):
            if f.name != "base.yaml":
                _fit_variant_share(f)
        gone = [f"left out {k}: {_one_line(v, staged=t, dest=dest)}" for k, v in sorted(left.items())]
        lines = [f"fitted {k}: {v}" for k, v in fitted.items()] + gone
        if gone:
            _write(t / "base.yaml", src, hf, diff, notes + gone)
        checked = []
        for f in sorted(t.glob("*.yaml")):
            load_recipe(f)  # raises RecipeError naming the file and key
            checked.append(f.name)
        _place(t, dest)
    for line in lines if say else ():
        say(line)
    return dest, checked


def _place(staged: Path, dest: Path) -> None:
    """Copy the staged files into a new ``dest``, made like any other folder (the umask decides its mode: the
    staging folder's is 0700, which copying the folder itself would carry over)."""
    try:
        dest.mkdir()
    except FileExistsError:
        raise RecipeError(
            f"{dest} already exists; refusing to overwrite it (pick another NAME or delete it first)"
        ) from None
    try:
        for f in sorted(staged.iterdir()):
            shutil.copyfile(f, dest / f.name)
    except BaseException:
        shutil.rmtree(dest)  # made just above by this call: nothing else is in it
        raise


def _fit_context(src, max_positions: int) -> tuple[dict, list[str]]:
    """Lower the source's rollout.max_model_len (and max_tokens) to what the model's positions allow."""
    r = src.rollout
    if r.max_model_len <= max_positions:
        return {}, []
    out = {"max_model_len": max_positions}
    prompt = src.data.max_prompt_tokens
    if r.max_tokens + prompt > max_positions:
        if max_positions - prompt < 1:
            raise RecipeError(
                f"the model has max_position_embeddings = {max_positions}, which leaves no room for responses after "
                f"data.max_prompt_tokens = {prompt} of the source recipe (fix: copy a recipe with shorter prompts)"
            )
        out["max_tokens"] = max_positions - prompt
    note = f"rollout.max_model_len {r.max_model_len} -> {max_positions} (the model's max_position_embeddings)"
    if "max_tokens" in out:
        note += f", rollout.max_tokens {r.max_tokens} -> {out['max_tokens']}"
    return out, [note]


def _fit_variants(staged: Path, src: Path, max_positions: int, left: dict[str, str]) -> dict[str, str]:
    """Make each staged variant validate for the new model, or remove it and record why in ``left``. A variant is
    taken after the files it inherits from (a variant of a variant left out is left out too). Returns what was
    fitted, by file name."""
    sources: dict[str, LoadedRecipe | RecipeError] = {}
    for f in staged.glob("*.yaml"):
        if f.name != "base.yaml":
            try:
                sources[f.name] = load_recipe(src / f.name)
            except RecipeError as e:
                sources[f.name] = e

    def depth(name: str) -> int:
        s = sources[name]
        return len(s.chain) if isinstance(s, LoadedRecipe) else 0

    fitted: dict[str, str] = {}
    for name in sorted(sources, key=lambda n: (depth(n), n)):
        try:
            note = _fit_variant(staged / name, src, sources[name], max_positions, left)
        except RecipeError as e:
            left[name] = str(e)
            (staged / name).unlink()
            continue
        if note:
            fitted[name] = note
    return fitted


def _fit_variant(
    f: Path, src: Path, source: LoadedRecipe | RecipeError, max_positions: int, left: dict[str, str]
) -> str | None:
    """None when the staged variant ``f`` validates as it is; else its lengths fitted as base.yaml's are (the
    note says how). Raises :class:`RecipeError` saying why it cannot be made to validate."""
    try:
        load_recipe(f)
        return None
    except RecipeError as e:
        problem = e
    if isinstance(source, RecipeError):
        raise RecipeError(f"it does not load in {src} either: {source}")
    here = src.resolve()
    gone = [p.name for p in source.chain if p.parent == here and p.name in left]
    if gone:
        raise RecipeError(f"it inherits from {gone[0]}, which was left out")
    fit, notes = _fit_context(source.recipe, max_positions)
    if not fit:
        raise problem
    text = read_text(f, root=f.parent, max_bytes=MAX_YAML_BYTES)
    data = yaml_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("rollout") or {}, dict):
        raise problem
    data["rollout"] = {**(data.get("rollout") or {}), **fit}
    write_atomic(
        f,
        _leading_comments(text)
        + f"# {notes[0]}: fitted by tim new-recipe\n"
        + yaml.safe_dump(data, sort_keys=False),
        root=f.parent,
    )
    load_recipe(f)  # still invalid: RecipeError, and the variant is left out
    return notes[0]


def _leading_comments(text: str) -> str:
    """The comment lines a YAML file starts with (what a variant says it is), kept when it is rewritten."""
    out = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        out.append(line + "\n")
    return "".join(out)


def _one_line(message: str, *, staged: Path, dest: Path) -> str:
    """A reason as one line, naming the new folder rather than the staging one."""
    message = message.replace(str(staged.absolute()), str(dest.absolute())).replace(str(staged), str(dest))
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return (lines[0] if lines else "invalid") + more


def _expert_tp(tp: int, ep: int, inherited: int | None) -> int | None:
    """The expert_tp the plan assumed (1 with expert parallelism, else tp), or None where the source's own value
    already gives it. Without expert parallelism it must equal tp, so a source's ``expert_tp: 1`` cannot be kept
    when the search picks ep = 1 and tp > 1 (expert counts without a power-of-two divisor, or large experts)."""
    if ep > 1:
        return 1
    return None if inherited in (None, tp) else tp


def _fit_variant_share(f: Path) -> None:
    """A variant that sets its own ``rollout.gpu_memory_utilization`` (e.g. the H100 variant's larger share beside
    offloaded state) gets the largest share that fits the new model, when its own does not; the line says so."""
    from tim_megatron.slurm.plan import estimate, largest_utilization

    text = f.read_text()
    own = re.search(r"gpu_memory_utilization: *([0-9.]+)", text)
    if own is None:
        return
    plan = estimate(load_recipe(f).recipe)
    if plan.fits:
        return
    share = largest_utilization(plan)
    if share <= 0 or share >= float(own.group(1)):
        return
    fitted = text[: own.start(1)] + f"{share:g}" + text[own.end(1) :]
    note = f"# rollout.gpu_memory_utilization {own.group(1)} -> {share:g}: the largest vLLM share that fits this model\n"
    f.write_text(note + fitted)
    if not estimate(load_recipe(f).recipe).fits:
        f.write_text(text)  # the share was not what kept it from fitting: left as it was


def _single_gpu_layout(folder: Path) -> list[str]:
    """Overrides that make any dimensions load on the cluster's whole world (the plan counts the vLLM engines on
    it); the search then picks the real layout. Data parallelism over the world first; where that does not divide
    the prompts of a step (a source of 64 nodes and 128 prompts), tensor parallelism takes a power of two of it."""
    c = load_recipe(
        folder / "base.yaml", ["parallel.tp=1", "parallel.ep=1", "parallel.expert_tp=null", "parallel.dp=1"]
    ).recipe.cluster
    world = c.nodes * max(c.gpus_per_node, 1)

    def layout(tp: int) -> list[str]:
        return [f"parallel.tp={tp}", "parallel.ep=1", "parallel.expert_tp=null", f"parallel.dp={world // tp}"]

    tp = 1
    while world % tp == 0:
        try:
            load_recipe(folder / "base.yaml", layout(tp))
            return layout(tp)
        except RecipeError:
            tp *= 2
    return layout(1)  # the probe's own error names what does not divide


def _write(path: Path, src: Path, hf: Path, diff: dict, notes: list[str]) -> None:
    body = {k: v for k, v in diff.items() if v is not None}
    if "parallel" in body:
        body["parallel"] = {k: v for k, v in body["parallel"].items() if v is not None}
    header = [
        f"Generated by `tim new-recipe` from {src}; dimensions from {hf}.",
        "Layout chosen by `tim plan` to fit the cluster's GPU memory (`make plan RECIPE=...` shows it).",
        *notes,
    ]
    comments = "".join(f"# {_comment_text(line)}\n" for line in header)
    path.write_text(comments + yaml.safe_dump(body, sort_keys=False))
    yaml_load(path.read_text())


def _comment_text(text: str) -> str:
    """``text`` as one comment line: every character that is not printable (a newline, a carriage return,
    YAML's other line breaks, terminal escapes) is written as its escape, so a path cannot end the comment."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


OPTIONAL_FEATURES = tuple(k for f in FEATURES if f.optional for k in f.fields)
"""``model.dims`` fields of features only some families have (group-limited routing, multi-head latent attention,
YaRN: ``recipe/dims.py`` FEATURES): written to a new recipe only when the model uses them."""


def written_dims(dims) -> dict:
    """``model.dims`` as a new recipe writes it: every field, less the optional features left at their defaults."""
    defaults = type(dims)()
    return {
        k: v for k, v in dims.model_dump().items() if k not in OPTIONAL_FEATURES or v != getattr(defaults, k)
    }
