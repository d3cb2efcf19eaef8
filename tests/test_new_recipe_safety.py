"""`tim new-recipe`, HF config.json reading and the Makefile's shell quoting, under hostile or unusual input.

Issue 21, item by item (what was tried; what happened before; what happens now):

- Item 10: `tim new-recipe` from Mixtral-8x22B's config.json, or any MoE with 1, 3 or 6 experts (no power-of-two
  expert parallelism fits them all). Before: the layout search picked ep=1 and the new base.yaml kept the source's
  `expert_tp: 1`, which the schema refuses with tp > 1 (no folder). Now: the expert_tp the plan assumed (tp when
  ep = 1) is written wherever the source's own value would not give it; the folder for 1, 3, 6 and 8 experts
  validates (for 8x22B the plan still says that nothing fits 80 GB GPUs: see the header it writes).
- Item 11: Qwen3-MoE (and Qwen3) config.json with `use_sliding_window: true`, `hidden_act: gelu` or
  sliding-attention `layer_types`. Before: accepted silently, a model built with the wrong attention or
  activation. Now: refused by name (key, value, what is supported), as the other families do.
- Item 18: an HF checkpoint path containing a newline (or another line break, such as U+2028) followed by YAML
  keys. Before: the path ended the generated base.yaml's header comment and its keys loaded (e.g.
  `run.steps: 7`). Now: every header line has its non-printable characters escaped (`\\n`); the keys are
  comment text, and model.path still holds the exact path (quoted by the YAML writer).
- Item 21: `make new-recipe NAME='x; touch CANARY #'` and the same payloads (`;`, quotes, backticks, `$(...)`)
  in every user variable of every make target. Before: expanded unquoted into the shell (CANARY appeared). Now:
  each value reaches the command as exactly one argument (OVERRIDES, RUNS and BENCH: one per word), and no
  canary file appears.
- Tracebacks list, as named errors (key, value, what is allowed): `architectures: [{...}]` (was `TypeError:
  unhashable type`), JSON nested 100,000 deep (was `RecursionError`), a 5000-digit integer (was Python's
  int-digits `ValueError`, no key), an odd `head_dim` (was "` = None`" with an empty key), a megabyte-long value
  (now cut short in the message), a NAME that is a dangling link (was a `FileExistsError` traceback).
- Beside the tracebacks list (item 9's fault, for config.json): a config.json that is a FIFO blocked
  `tim new-recipe` forever; one linked to /dev/zero (size 0, so the size limit passed) was read until memory ran
  out. Now a config.json that is not a regular file is refused by name, and at most the size limit is read.
- Tracebacks list, "new-recipe output folders are mode 0700": the folder was copied with its staging
  TemporaryDirectory's mode. Now it is made like any other folder: the umask decides (0750 under umask 027).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe_check import check_dir
from tim_megatron.slurm.new_recipe import new_recipe

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "hf-configs"
SOURCE = "qwen3-30b-a3b"


@pytest.fixture
def recipes_root(tmp_path):
    root = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes" / SOURCE, root / SOURCE)
    return root


def _hf(folder: Path, cfg: dict | str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return folder


def _published(model: str, **change) -> dict:
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    cfg.update(change)
    return cfg


def _made(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ------------------------------------------------------------------------------------------- item 10


MIXTRAL_8X22B = _published(
    "Mixtral-8x7B-v0.1",
    hidden_size=6144,
    intermediate_size=16384,
    max_position_embeddings=65536,
    num_attention_heads=48,
    num_hidden_layers=56,
    vocab_size=32768,
)
"""Mixtral-8x22B-v0.1's published dimensions (its config.json differs from 8x7B's in these keys only)."""


@pytest.mark.parametrize("experts", [1, 3, 6, 8])
def test_new_recipe_writes_a_valid_expert_layout_for_any_expert_count(experts, recipes_root, tmp_path):
    """Item 10: with ep = 1 the recipe's expert_tp equals tp, whatever the source recipe had (its 1 here)."""
    cfg = {**MIXTRAL_8X22B, "num_local_experts": experts, "num_experts_per_tok": min(2, experts)}
    hf = _hf(tmp_path / "hf", cfg)
    dest, checked = new_recipe(recipes_root / SOURCE, f"mixtral-{experts}", hf, recipes_root=recipes_root)
    assert "base.yaml" in checked and all(err is None for _, err in check_dir(dest))
    p = load_recipe(dest / "grpo.yaml").recipe.parallel
    assert experts % p.ep == 0
    assert p.etp == (1 if p.ep > 1 else p.tp)


# ------------------------------------------------------------------------------------------- item 11

QWEN3_DENSE = {**_published("Qwen3-235B-A22B"), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


@pytest.mark.parametrize(
    "cfg,match",
    [
        (
            _published("Qwen3-235B-A22B", use_sliding_window=True, sliding_window=4096),
            r"Qwen3MoeForCausalLM: use_sliding_window = True is not supported: sliding-window attention "
            r"\(sliding_window = 4096\) is not implemented; allowed: false",
        ),
        (
            _published("Qwen3-235B-A22B", hidden_act="gelu"),
            r"Qwen3MoeForCausalLM: hidden_act = 'gelu' is not supported: only SwiGLU \(silu\) experts",
        ),
        (
            _published("Qwen3-235B-A22B", use_sliding_window="yes"),
            r"use_sliding_window = 'yes': allowed: true or false",
        ),
        (
            {**QWEN3_DENSE, "use_sliding_window": True},
            r"Qwen3ForCausalLM: use_sliding_window = True is not supported",
        ),
        (
            {**QWEN3_DENSE, "layer_types": ["full_attention"] * 93 + ["sliding_attention"]},
            r"Qwen3ForCausalLM: layer_types\[93\] = 'sliding_attention' is not supported: only full attention "
            r"is implemented; allowed: \"full_attention\" in every layer",
        ),
        (
            {**QWEN3_DENSE, "hidden_act": "gelu_pytorch_tanh"},
            r"Qwen3ForCausalLM: hidden_act = 'gelu_pytorch_tanh' is not supported: only SwiGLU \(silu\) MLPs",
        ),
    ],
    ids=[
        "moe-sliding-window",
        "moe-gelu",
        "moe-sliding-window-not-bool",
        "dense-sliding-window",
        "dense-layer-types",
        "dense-gelu",
    ],
)
def test_qwen3_sliding_window_and_other_activations_are_refused(cfg, match, recipes_root, tmp_path):
    """Item 11: refused by name before anything is written."""
    hf = _hf(tmp_path / "hf", cfg)
    with pytest.raises(RecipeError, match=match):
        new_recipe(recipes_root / SOURCE, "x", hf, recipes_root=recipes_root)
    assert _made(recipes_root) == [SOURCE]


def test_qwen3_published_settings_still_load():
    """The published switches (sliding window off, a size given anyway, full-attention layer types) load."""
    from tim_megatron.trainer.hf_config import dims_from_hf

    ok = {**QWEN3_DENSE, "sliding_window": 4096, "layer_types": ["full_attention"] * 94}
    assert dims_from_hf(ok).resolved_family == "qwen3"
    assert dims_from_hf(_published("Qwen3-235B-A22B")).num_experts == 128


# ------------------------------------------------------------------------------------------- item 18


@pytest.mark.parametrize("brk", ["\n", "\r\n", "\u2028"], ids=["newline", "crlf", "line-separator"])
def test_a_line_break_in_the_hf_path_stays_inside_the_header_comment(brk, recipes_root, tmp_path):
    """Item 18: the path's YAML keys are comment text; the recipe keeps the source's values."""
    hf = _hf(tmp_path / f"m{brk}run:{brk}  steps: 7{brk}#", _published("OLMoE-1B-7B-0924"))
    dest, _ = new_recipe(recipes_root / SOURCE, "olmoe", hf, recipes_root=recipes_root)
    text = (dest / "base.yaml").read_text()
    doc = yaml.safe_load(text)
    assert "run" not in doc
    assert doc["model"]["path"] == str(hf)  # the exact path, quoted
    assert (
        load_recipe(dest / "grpo.yaml").recipe.run.steps
        == load_recipe(recipes_root / SOURCE / "grpo.yaml").recipe.run.steps
    )
    escaped = brk.encode("unicode_escape").decode("ascii")
    assert f"dimensions from {tmp_path}/m{escaped}run:{escaped}  steps: 7{escaped}#." in text
    header = text.split("base:")[0]
    assert all(line.startswith("# ") for line in header.splitlines())


# ------------------------------------------------------------------------------------------- item 21

ARGV = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
"""Stands in for `tim` (and `python`): prints the arguments the shell gave it, as one JSON line."""


def _payload(canary: Path) -> str:
    return f"x; touch {canary} #'; touch {canary}; '\" `touch {canary}` $(touch {canary}) a\\b"


def _make(target: str, **variables: str) -> subprocess.CompletedProcess:
    # "$" is make's own escape; every other character reaches the Makefile as typed.
    args = [f"{k}={v.replace('$', '$$')}" for k, v in variables.items()]
    return subprocess.run(
        # -o: never remake the venv stamp (setup would reinstall the package)
        [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.tim-setup-stamp",
            target,
            f"TIM={ARGV}",
            f"PY={ARGV}",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def _argv(res: subprocess.CompletedProcess) -> list[str]:
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(next(line for line in res.stdout.splitlines() if line.startswith("[")))


def test_make_passes_each_user_value_as_one_argument(tmp_path):
    """Item 21: a hostile value in any variable of any target is one argument; no canary appears."""
    canary = tmp_path / "CANARY"
    bad = _payload(canary)
    word = f"k=1;touch{canary}`touch{canary}`'\""  # OVERRIDES, RUNS and BENCH split on spaces only
    cases = [
        (
            "new-recipe",
            dict(FROM=bad, NAME=bad, HF=bad, RECIPES_ROOT=bad),
            ["new-recipe", bad, bad, bad, "--recipes-root", bad],
        ),
        ("plan", dict(RECIPE=bad, OVERRIDES=f"a=1 {word}"), ["plan", bad, "a=1", word]),
        (
            "submit",
            dict(RECIPE=bad, OVERRIDES=word, NODES=bad, DRY_RUN="1"),
            ["submit", bad, word, "--nodes", bad, "--dry-run"],
        ),
        ("sweep", dict(SWEEP=bad, OVERRIDES=word), ["sweep", bad, word]),
        ("logs", dict(JOB=bad, ROOT=bad), ["logs", bad, "--root", bad]),
        ("cancel", dict(JOB=bad), ["cancel", bad]),
        (
            "report",
            dict(RUNS=f"{word} b", SWEEP=bad, NAME=bad, ROOT=bad),
            ["report", word, "b", "--sweep", bad, "--name", bad, "--root", bad],
        ),
        ("report", dict(SWEEP=bad), ["report", "--sweep", bad]),
        ("doctor", dict(RECIPE=bad, OVERRIDES=word, NODES=bad), ["doctor", bad, word, "--nodes", bad]),
        ("preflight", dict(RECIPE=bad, OVERRIDES=word, NODES=bad), ["preflight", bad, word, "--nodes", bad]),
        ("demo", dict(RECIPE=bad, OVERRIDES=word), ["train", bad, word]),
        ("lab", dict(PRESET=bad, ONLY=bad, JOBS=bad), ["lab", bad, "--only", bad, "--jobs", bad]),
        ("gpu-check", dict(GPU_CHECK_JSON=bad), ["-m", "tim_megatron.gpu_check", "--json", bad]),
        ("bench", dict(BENCH=word), ["-m", "tim_megatron.bench", word]),
    ]
    for target, variables, want in cases:
        res = _make(target, **variables)
        assert _argv(res) == want, (target, res.stdout)
        assert not canary.exists(), target
    for target, var in (("demo", "RECIPE"), ("lab", "PRESET")):  # echoed in the closing line too
        assert f"make {target}: " in _make(target, **{var: bad}).stdout and not canary.exists()


def test_make_new_recipe_with_a_hostile_name_is_refused_by_tim(recipes_root, tmp_path):
    """Item 21, end to end: the real `tim` gets the whole NAME and refuses it; the shell runs nothing."""
    canary = tmp_path / "CANARY"
    res = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.tim-setup-stamp",
            "new-recipe",
            f"TIM={Path(sys.executable).parent / 'tim'}",
            f"FROM={recipes_root / SOURCE}",
            f"NAME=x; touch {canary} #",
            f"HF={CONFIGS / 'OLMoE-1B-7B-0924'}",
            f"RECIPES_ROOT={recipes_root}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"NAME='x; touch {canary} #': allowed: lowercase letters" in res.stdout + res.stderr
    assert not canary.exists() and _made(recipes_root) == [SOURCE]


# ----------------------------------------------------------------------------------- tracebacks list


@pytest.mark.parametrize(
    "text,match",
    [
        (
            json.dumps(_published("Qwen3-235B-A22B", architectures=[{"name": "Qwen3MoeForCausalLM"}])),
            r"architectures = \[\{'name': 'Qwen3MoeForCausalLM'\}\]: allowed: a list of class names \(strings\)",
        ),
        (
            json.dumps(_published("Qwen3-235B-A22B"))[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"config.json: JSON nested too deeply to read; allowed: a JSON object of model settings",
        ),
        (
            json.dumps(_published("Qwen3-235B-A22B", hidden_size=None))[:-1]
            + ', "hidden_size": '
            + "7" * 5000
            + "}",
            r"config.json: line 1: key 'hidden_size' is an integer of 5000 digits; allowed: integers of at most "
            r"100 digits",
        ),
        (
            json.dumps(_published("Qwen3-235B-A22B", head_dim=127)),
            r"Qwen3MoeForCausalLM: partial_rotary_factor = 1.0, head_dim = 127: partial_rotary_factor = 1.0 x "
            r"head_dim = 127 must be an even whole number of rotated channels \(model.dims.partial_rotary_factor, "
            r"model.dims.head_dim; fix",
        ),
        (
            json.dumps(_published("Qwen3-235B-A22B", hidden_act="g" * 1_000_000)),
            r"hidden_act = 'g{30,}\.\.\.g+' is not supported",
        ),
    ],
    ids=["architectures-of-objects", "nested-json", "5000-digit-int", "odd-head-dim", "megabyte-value"],
)
def test_bad_config_json_is_a_named_error(text, match, recipes_root, tmp_path):
    """Tracebacks list: each is a RecipeError (the CLI's `error: ...`, exit 2) naming key, value and what is
    allowed, short however large the value, and no folder appears."""
    hf = _hf(tmp_path / "hf", text)
    with pytest.raises(RecipeError, match=match) as e:
        new_recipe(recipes_root / SOURCE, "x", hf, recipes_root=recipes_root)
    msg = str(e.value)
    assert len(msg) < 1000 and "= None" not in msg and ":  =" not in msg
    assert _made(recipes_root) == [SOURCE]


def test_a_dangling_link_as_name_is_a_named_error(recipes_root, tmp_path):
    """Tracebacks list: NAME is a link to nowhere under the recipes folder; nothing is written through it."""
    (recipes_root / "x").symlink_to(tmp_path / "nowhere")
    with pytest.raises(
        RecipeError,
        match=rf"NAME='x': {recipes_root / 'x'} is a link to .*nowhere', which does "
        r"not exist; allowed: a name that is free",
    ):
        new_recipe(recipes_root / SOURCE, "x", CONFIGS / "OLMoE-1B-7B-0924", recipes_root=recipes_root)
    assert not (tmp_path / "nowhere").exists() and _made(recipes_root) == [SOURCE, "x"]


def test_new_recipe_folder_follows_the_umask(recipes_root):
    """Tracebacks list: the new folder and its files get the umask's mode (was 0700 from the staging folder)."""
    old = os.umask(0o027)
    try:
        dest, _ = new_recipe(
            recipes_root / SOURCE, "olmoe", CONFIGS / "OLMoE-1B-7B-0924", recipes_root=recipes_root
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o750
    assert {stat.S_IMODE(f.stat().st_mode) for f in dest.iterdir()} == {0o640}
    assert _made(recipes_root) == ["olmoe", SOURCE]  # the staging folder is gone


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_config_json_that_is_not_a_file_is_a_named_error(kind, tmp_path):
    """Tracebacks list (as item 9 for metrics.jsonl): a config.json that is a FIFO blocked `tim new-recipe`
    forever, and a link to /dev/zero (size 0) was read without end. Now both are refused before reading."""
    import resource

    hf = tmp_path / "hf"
    hf.mkdir()
    if kind == "fifo":
        os.mkfifo(hf / "config.json")
    else:
        (hf / "config.json").symlink_to("/dev/zero")
    code = (
        "import sys; from tim_megatron.trainer.hf_config import read_hf_config; read_hf_config(sys.argv[1])"
    )

    def cap_memory():  # before the fix /dev/zero filled memory: a MemoryError here, not a swapping machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    res = subprocess.run(
        [sys.executable, "-c", code, str(hf)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        preexec_fn=cap_memory,
    )
    assert (
        f"HFConfigError: {hf / 'config.json'}: not a regular file; allowed: a config.json file" in res.stderr
    )


# ------------------------------------------------------------------------------------------- variants

TIM = str(Path(sys.executable).parent / "tim")


def _tiny_config(family: str, **dims) -> dict:
    """A tiny model's config.json of ``family`` with ``dims`` changed (e.g. a shorter max_position_embeddings)."""
    from tim_megatron.trainer.families import get_family

    fam = get_family(family)
    cfg = fam.hf_config(fam.tiny.model_copy(update=dims)).to_dict()
    cfg["architectures"] = list(fam.architectures)
    return cfg


def _new_recipe_cli(root: Path, name: str, hf: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TIM, "new-recipe", str(root / "tiny-moe"), name, str(hf), "--recipes-root", str(root)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def _recipe_check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TIM, "recipe", "check", str(folder)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.fixture
def tiny_root(tmp_path):
    root = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes" / "tiny-moe", root / "tiny-moe")
    return root


def test_new_recipe_fits_every_variant_to_a_model_with_fewer_positions(tiny_root, tmp_path):
    """`tim new-recipe` from recipes/tiny-moe for a tiny MoE of 128 positions. Before: it failed on lab.yaml's
    `rollout.max_model_len: 272` (variants were copied as they were; no folder). Now: lab.yaml's lengths are fitted
    as base.yaml's are (max_model_len to the model's positions, max_tokens to what the prompts leave), the other
    variants are copied unchanged, and every file passes `tim recipe check`."""
    src = tiny_root / "tiny-moe"
    hf = _hf(tmp_path / "hf", _tiny_config("qwen3_moe", max_position_embeddings=128))
    res = _new_recipe_cli(tiny_root, "short", hf)
    assert res.returncode == 0, res.stdout + res.stderr
    dest = tiny_root / "short"
    assert _made(dest) == _made(src)
    check = _recipe_check(dest)
    assert check.returncode == 0 and f"{len(_made(src))}/{len(_made(src))} recipes valid" in check.stdout, (
        check.stdout
    )
    lab = load_recipe(dest / "lab.yaml").recipe
    source_lab = load_recipe(src / "lab.yaml").recipe
    assert (lab.rollout.max_model_len, lab.rollout.max_tokens) == (128, 128 - lab.data.max_prompt_tokens)
    assert (lab.rl, lab.data) == (source_lab.rl, source_lab.data)  # nothing else changed
    assert "rollout.max_model_len 272 -> 128" in (dest / "lab.yaml").read_text()
    assert "fitted lab.yaml: rollout.max_model_len 272 -> 128" in res.stdout
    for same in ("countdown.yaml", "gspo.yaml", "vexact.yaml"):
        assert (dest / same).read_text() == (src / same).read_text()
    assert "left out" not in res.stdout


def test_new_recipe_leaves_out_the_variants_the_model_cannot_run_and_names_them(tiny_root, tmp_path):
    """The same for a tiny DeepSeek-V3 of 128 positions: the exact-mode variants (vexact.yaml and the three that
    inherit from it) cannot run multi-head latent attention. Before: the whole command failed. Now: each is left
    out with a line that says why, the header of base.yaml lists them, and the rest pass `tim recipe check`."""
    src = tiny_root / "tiny-moe"
    hf = _hf(tmp_path / "hf", _tiny_config("deepseek_v3", max_position_embeddings=128))
    res = _new_recipe_cli(tiny_root, "ds", hf)
    assert res.returncode == 0, res.stdout + res.stderr
    dest = tiny_root / "ds"
    left = {"vexact.yaml", "vexact-bias.yaml", "vexact-noise.yaml", "vexact-precision.yaml"}
    assert set(_made(src)) - set(_made(dest)) == left
    assert "left out vexact.yaml: " in res.stdout
    assert "diagnostics.vexact = exact with multi-head latent attention" in res.stdout
    for child in left - {"vexact.yaml"}:
        assert f"left out {child}: it inherits from vexact.yaml, which was left out" in res.stdout
    assert str(tiny_root / "ds.new-") not in res.stdout  # errors name the new folder, not the staging one
    header = (dest / "base.yaml").read_text().split("base:")[0]
    assert all(f"# left out {name}: " in header for name in left)
    check = _recipe_check(dest)
    assert check.returncode == 0 and f"{len(_made(dest))}/{len(_made(dest))} recipes valid" in check.stdout
    assert load_recipe(dest / "lab.yaml").recipe.rollout.max_model_len == 128


def test_new_recipe_from_a_source_with_more_gpus_than_prompts(tmp_path):
    """`tim new-recipe` from recipes/deepseek-v3 (64 nodes x 8 GPUs, 128 prompts a step) for the published
    DeepSeek-V3. Before: the layout search's probe put data parallelism over all 512 GPUs, which does not divide
    128 prompts, and the command failed on that (`data.prompts_per_step = 128 must be a multiple of parallel.dp =
    512`) whatever the model. Now: the probe takes tensor parallelism where needed, and the layout found is the
    source's own."""
    root = tmp_path / "recipes"
    for name in ("deepseek-v3", "qwen3-30b-a3b"):  # the first inherits from the second
        shutil.copytree(ROOT / "recipes" / name, root / name)
    dest, checked = new_recipe(root / "deepseek-v3", "ds", CONFIGS / "DeepSeek-V3", recipes_root=root)
    assert set(checked) == {p.name for p in (root / "deepseek-v3").glob("*.yaml")}
    assert all(err is None for _, err in check_dir(dest))
    new, old = (load_recipe(f).recipe for f in (dest / "grpo.yaml", root / "deepseek-v3" / "grpo.yaml"))
    assert (new.parallel, new.cluster.nodes, new.model.dims) == (
        old.parallel,
        old.cluster.nodes,
        old.model.dims,
    )


def test_a_variant_that_is_a_fifo_or_a_link_is_left_out_unread(tiny_root, tmp_path):
    """A source folder whose `wait.yaml` is a FIFO and `elsewhere.yaml` a link to a recipe outside it. Before: the
    command stopped with a traceback (`shutil.SpecialFileError: ... wait.yaml is a named pipe`), and without the
    FIFO the link's target outside the folder was read and copied in. Now: neither is read; each is left out with
    a line naming what it is, and the rest is written."""
    src = tiny_root / "tiny-moe"
    os.mkfifo(src / "wait.yaml")
    outside = tmp_path / "outside.yaml"
    outside.write_text("base: base.yaml\n")
    (src / "elsewhere.yaml").symlink_to(outside)
    hf = _hf(tmp_path / "hf", _tiny_config("qwen3_moe"))
    res = _new_recipe_cli(tiny_root, "copy", hf, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "left out wait.yaml: not copied: " in res.stdout and "a FIFO" in res.stdout
    assert "left out elsewhere.yaml: not copied: " in res.stdout and "symbolic link" in res.stdout
    dest = tiny_root / "copy"
    assert set(_made(src)) - set(_made(dest)) == {"wait.yaml", "elsewhere.yaml"}
    assert _recipe_check(dest).returncode == 0
