"""Recipes: inheritance, overrides, validation errors, and every shipped recipe resolves offline."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.loader import all_keys, parse_override
from tim_megatron.recipe_check import check_dir

ROOT = Path(__file__).resolve().parents[1]


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_base_chain_and_list_of_bases(tmp_path):
    write(tmp_path, "a.yaml", "rl: {clip: {low: 0.1, high: 0.1}}\nrun: {steps: 3}\n")
    write(tmp_path, "b.yaml", "rl: {clip: {high: 0.3}}\n")
    c = write(tmp_path, "sub/c.yaml", "base: [../a.yaml, ../b.yaml]\nrun: {seed: 7}\n")
    loaded = load_recipe(c)
    r = loaded.recipe
    assert (r.rl.clip.low, r.rl.clip.high, r.run.steps, r.run.seed) == (0.1, 0.3, 3, 7)
    assert loaded.provenance["rl.clip.high"].endswith("b.yaml")
    assert loaded.name == "sub-c"


def test_overrides_are_coerced_to_schema_types(tmp_path):
    p = write(tmp_path, "r.yaml", "run: {steps: 3}\n")
    r = load_recipe(
        p, ["rl.clip.high=0.28", "run.steps=5", "remedies.fp32_lm_head=true", "rollout.stop=[a, b]"]
    ).recipe
    assert r.rl.clip.high == 0.28 and isinstance(r.rl.clip.high, float)
    assert r.run.steps == 5 and r.remedies.fp32_lm_head is True and r.rollout.stop == ["a", "b"]
    assert parse_override("a.b=1e-3") == ("a.b", 1e-3)


def test_bad_value_names_file_key_value_and_allowed(tmp_path):
    p = write(tmp_path, "r.yaml", "rl:\n  loss: ppo\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert str(p) in msg and "rl.loss" in msg and "'ppo'" in msg and "token_clip" in msg and "gspo" in msg


def test_bad_override_is_attributed_to_the_command_line(tmp_path):
    p = write(tmp_path, "r.yaml", "{}\n")
    with pytest.raises(RecipeError, match=r"command line: rl.clip.high = 'abc'.*number"):
        load_recipe(p, ["rl.clip.high=abc"])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param(
            "rl:\n  clip:\n    hihg: 0.3\n",
            r"unknown key 'rl.clip.hihg' \(did you mean 'rl.clip.high'\?\)",
            id="unknown-key-did-you-mean",
        ),
        pytest.param("ppo_epochs: 2\n", r"did you mean 'rl.ppo_epochs'", id="key-outside-its-section"),
        pytest.param("base: nope.yaml\n", r"base = 'nope.yaml': file not found", id="missing-base"),
        pytest.param("rl: [unclosed\n", "not valid YAML", id="bad-yaml"),
    ],
)
def test_a_bad_recipe_file_is_refused_with_the_reason(tmp_path, text, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(write(tmp_path, "r.yaml", text))


def test_gspo_with_token_mean_is_rejected(tmp_path):
    p = write(tmp_path, "r.yaml", "rl: {loss: gspo, aggregation: token-mean}\n")
    with pytest.raises(RecipeError, match=r"rl.loss = gspo needs rl.aggregation = seq-mean-token-mean"):
        load_recipe(p)
    assert load_recipe(p, ["rl.aggregation=seq-mean-token-mean"]).recipe.rl.loss == "gspo"


def test_ep_must_divide_experts_and_tp_heads(tmp_path):
    p = write(tmp_path, "r.yaml", "parallel: {ep: 3, dp: 3}\n")
    with pytest.raises(RecipeError, match=r"parallel.ep = 3 must divide model.dims.num_experts = 8"):
        load_recipe(p)
    with pytest.raises(RecipeError, match=r"parallel.tp = 3 must divide model.dims.num_attention_heads = 4"):
        load_recipe(p, ["parallel.ep=1", "parallel.tp=3", "parallel.dp=1"])


def test_cyclic_base_chain_is_detected(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    b = write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(RecipeError, match=r"cyclic base chain: .*b.yaml -> .*a.yaml -> .*b.yaml"):
        load_recipe(b)


def test_precision_mismatch_must_be_declared(tmp_path):
    p = write(tmp_path, "r.yaml", "trainer: {dtype: float32}\nrollout: {dtype: bfloat16}\n")
    with pytest.raises(RecipeError, match="allow_precision_mismatch"):
        load_recipe(p)
    r = load_recipe(p, ["diagnostics.allow_precision_mismatch=true"]).recipe
    assert (r.trainer_dtype, r.rollout_dtype) == ("float32", "bfloat16")
    fp16 = load_recipe(write(tmp_path, "f.yaml", "remedies: {fp16: true}\n")).recipe
    assert (fp16.trainer_dtype, fp16.rollout_dtype) == ("float16", "float16")
    with pytest.raises(RecipeError, match="contradicts remedies.fp16"):
        load_recipe(write(tmp_path, "g.yaml", "remedies: {fp16: true}\ntrainer: {dtype: bfloat16}\n"))


def test_run_name_cannot_escape_the_runs_folder(tmp_path):
    p = write(tmp_path, "r.yaml", "{}\n")
    for bad in ["../x", "a/b", "$(id)", "a;b", ".hidden"]:
        with pytest.raises(RecipeError, match="run.name"):
            load_recipe(p, [f"run.name={bad}"])


def test_every_schema_field_has_a_docstring():
    from pydantic import BaseModel

    from tim_megatron.recipe.loader import _model_of
    from tim_megatron.recipe.schema import Recipe

    def walk(model: type[BaseModel], prefix=""):
        for name, f in model.model_fields.items():
            assert f.description, f"{prefix}{name} has no docstring"
            sub = _model_of(f.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(Recipe)
    assert len(all_keys()) > 100


def test_shipped_recipes_all_valid():
    results = check_dir(ROOT / "recipes")
    assert results, "no recipes shipped"
    bad = [(p, e) for p, e in results if e]
    assert not bad, bad


def test_recipe_file_names_follow_the_grammar():
    for p in (ROOT / "recipes").rglob("*.yaml"):
        assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*\.yaml", p.name), p
        assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", p.parent.name), p.parent


def test_cli_recipe_show_and_check(tmp_path):
    tim = [sys.executable, "-m", "tim_megatron.cli"]
    out = subprocess.run(
        [*tim, "recipe", "show", str(ROOT / "recipes/tiny-moe/grpo.yaml"), "rl.clip.high=0.28"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "high: 0.28" in out.stdout and "run name: tiny-moe-grpo" in out.stdout
    ok = subprocess.run([*tim, "recipe", "check", "recipes"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = write(tmp_path, "bad/x.yaml", "rl: {clip: {hihg: 1}}\n")
    res = subprocess.run([*tim, "recipe", "check", str(bad.parent)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1 and "did you mean 'rl.clip.high'" in res.stdout


def test_cli_simulate_precision_is_comparable_to_table_2():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tim_megatron.cli",
            "simulate",
            "precision",
            "--samples",
            "8000",
            "--seed",
            "1234",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    row = out.stdout.strip().splitlines()[-1].split("\t")
    mean, std, mx, mn = map(float, row[1:5])
    assert abs(mean - 1.0) < 1e-3
    assert 0.0040 < std < 0.0056  # Table 2: 0.0048
    assert 1.010 < mx < 1.025 and 0.975 < mn < 0.990  # Table 2: 1.019 / 0.981


# ------------------------------------------------------------------------- every field is read somewhere


class _Reads(ast.NodeVisitor):
    """Attribute chains (``recipe.rollout.temperature``) per function, and where each name may come from."""

    def __init__(self, section_paths: dict[str, list[tuple[str, ...]]]):
        self.section_paths = section_paths
        self.params: dict[str, list[list[str]]] = {}  # function name -> parameter names (one list per def)
        self.aliases: dict[tuple[str, str], set] = {}  # (scope, dotted name) -> {(scope, chain)}
        self.chains: set[tuple[str, tuple[str, ...]]] = set()  # (scope, chain)
        self.calls: list = []  # (scope, callee, positional chains, keyword chains, is a method call)
        self.scope, self.cls = ["<module>"], [None]

    @staticmethod
    def chain(node) -> tuple[str, ...] | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return (node.id, *reversed(parts)) if isinstance(node, ast.Name) else None

    def visit_ClassDef(self, node):
        self.cls.append(node.name)
        self.generic_visit(node)
        self.cls.pop()

    def visit_FunctionDef(self, node):
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.params.setdefault(node.name, []).append([a.arg for a in args])
        scope = f"{self.cls[-1]}.{node.name}" if self.cls[-1] else node.name
        for a in args:  # `cfg: DatasetConfig` holds data.train or data.val
            words = (
                ast.unparse(a.annotation).replace("|", " ").replace('"', " ").split() if a.annotation else []
            )
            for w in words:
                for p in self.section_paths.get(w, []):
                    self.aliases.setdefault((scope, a.arg), set()).add(("<schema>", p))
        for p in self.section_paths.get(self.cls[-1], []):  # in a schema class, self is that section
            self.aliases.setdefault((scope, "self"), set()).add(("<schema>", p))
        self.scope.append(scope)
        self.generic_visit(node)
        self.scope.pop()

    def _alias(self, target, value):
        t, v = self.chain(target), self.chain(value)
        if t and v:  # `c = recipe.cluster`, `self.cfg = cfg`
            scope = self.cls[-1] if t[0] == "self" and self.cls[-1] else self.scope[-1]
            self.aliases.setdefault((scope, ".".join(t)), set()).add((self.scope[-1], v))

    def visit_Assign(self, node):
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for a, b in zip(t.elts, node.value.elts, strict=False):
                    self._alias(a, b)
            else:
                self._alias(t, node.value)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        callee = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if callee:
            kw = {k.arg: self.chain(k.value) for k in node.keywords if k.arg}
            pos = [self.chain(a) for a in node.args]
            self.calls.append((self.scope[-1], callee, pos, kw, isinstance(f, ast.Attribute)))
        self.generic_visit(node)

    def visit_Attribute(self, node):
        c = self.chain(node)
        if c:
            self.chains.add((self.scope[-1], c))
        self.generic_visit(node)


def _read_chains(files: list[Path], section_paths) -> set[tuple[str, ...]]:
    r = _Reads(section_paths)
    for f in files:
        r.visit(ast.parse(f.read_text()))
    scopes = {s for s, _ in r.chains} | {s for s, _ in r.aliases}
    for scope, callee, pos, kw, is_method in r.calls:  # `build_schedule(recipe.remedies.lr_schedule, ...)`
        for names in r.params.get(callee, []):
            names = names[1:] if is_method and names[:1] == ["self"] else names
            for name, c in [*zip(names, pos, strict=False), *kw.items()]:
                for s in (s for s in scopes if c and s.split(".")[-1] == callee):
                    r.aliases.setdefault((s, name), set()).add((scope, c))

    def expand(scope, c, depth=0):
        yield c
        cls = scope.split(".")[0] if "." in scope else None
        for i in range(len(c), 0, -1) if depth < 6 else ():
            key = ".".join(c[:i])
            found = r.aliases.get((scope, key), set())
            if cls and c[0] == "self":
                found = found | r.aliases.get((cls, key), set())
            if found:
                for s2, a in found:
                    if a != c[:i]:
                        yield from expand(s2, (*a, *c[i:]), depth + 1)
                return

    return {full for scope, c in r.chains for full in expand(scope, c)}


# Fields read only dynamically (getattr, model_dump into a call), with where. None so far.
READ_DYNAMICALLY: dict[str, str] = {}


def test_every_schema_field_is_read_somewhere():
    """A recipe key that nothing reads is a lie: setting it changes nothing (rollout.engine, rollout.seed and
    data.seed were such keys).

    Method: parse every module of ``tim_megatron/`` and ``patches/`` and collect attribute chains
    (``recipe.rollout.temperature``), resolving the names they start from through plain assignments
    (``c = recipe.cluster``; ``self.cfg = cfg``), through call sites (``build_schedule(recipe.remedies.lr_schedule)``
    makes ``cfg`` inside ``build_schedule`` that section), through parameter annotations naming a schema class
    (``cfg: DatasetConfig``) and through ``self`` inside the schema's own classes. A field counts as read when a
    chain holds its parent section's name followed by its own name (``rollout.seed``, not just ``.seed``, which
    ``run.seed`` would satisfy). Plain grep for ``.seed`` cannot tell the two apart.
    """
    from tim_megatron.recipe.loader import _model_of
    from tim_megatron.recipe.schema import Recipe

    def walk(model, path=()):
        for name, f in model.model_fields.items():
            sub = _model_of(f.annotation)
            yield (*path, name), sub
            if sub is not None:
                yield from walk(sub, (*path, name))

    section_paths: dict[str, list[tuple[str, ...]]] = {"Recipe": [("recipe",)]}
    for path, sub in walk(Recipe):
        if sub is not None:
            section_paths.setdefault(sub.__name__, []).append(("recipe", *path))
    files = [*(ROOT / "tim_megatron").rglob("*.py"), *(ROOT / "patches").rglob("*.py")]
    chains = _read_chains(files, section_paths)

    def is_read(path):
        want = path[-2:]
        return any(c[i : i + 2] == want for c in chains for i in range(len(c) - 1))

    unread = [".".join(p) for p, sub in walk(Recipe) if sub is None and not is_read(p)]
    assert [k for k in unread if k not in READ_DYNAMICALLY] == [], "recipe keys nothing reads"
    assert len(chains) > 1000  # the walk saw the package


def test_an_unread_field_is_caught(tmp_path):
    """The detector itself: a module that reads run.seed does not make rollout.seed read."""
    mod = tmp_path / "m.py"
    mod.write_text("def f(recipe):\n    s = recipe.run\n    return s.seed, recipe.rollout.n\n")
    chains = _read_chains([mod], {"Recipe": [("recipe",)]})
    assert ("recipe", "run", "seed") in chains and ("recipe", "rollout", "n") in chains
    assert not any(c[i : i + 2] == ("rollout", "seed") for c in chains for i in range(len(c) - 1))


def test_plain_yaml_scalars_follow_the_yaml_1_2_core_schema():
    """YAML 1.1 (PyYAML's default) reads 0x10 as 16, 1_000 as 1000, yes/on as True, 72:00:00 as 259200 and
    010 as 8; typed fields would then accept numbers nobody wrote. Here they stay text (and get refused)."""
    cases = {
        "0x10": "0x10",
        "0o17": "0o17",
        "1_000": "1_000",
        "yes": "yes",
        "on": "on",
        "72:00:00": "72:00:00",
        "2026-01-01": "2026-01-01",
        "010": 10,
        "-3": -3,
        "1e-3": 1e-3,
        "2.5": 2.5,
        "true": True,
        "False": False,
        "~": None,
    }
    for raw, want in cases.items():
        _, got = parse_override(f"a={raw}")
        assert got == want and type(got) is type(want), (raw, got)
    assert (
        parse_override("a=.inf")[1] == float("inf")
        and parse_override("a=.nan")[1] != parse_override("a=.nan")[1]
    )


def test_resolved_recipes_round_trip_through_the_strict_loader(tmp_path):
    """A run folder's recipe.yaml (written by recipe_to_yaml) reads back to the same recipe: the YAML 1.2
    scalars and strict types accept everything the dumper writes (floats like 1.0e-06, .inf, quoted strings)."""
    from tim_megatron.recipe import recipe_to_yaml

    paths = [p for p in sorted((ROOT / "recipes").rglob("*.yaml")) if "sweeps" not in p.parts]
    for p in paths:
        r = load_recipe(p).recipe
        f = tmp_path / "run" / "recipe.yaml"
        f.parent.mkdir(exist_ok=True)
        f.write_text(recipe_to_yaml(r))
        assert load_recipe(f).recipe == r, p
    inf = load_recipe(paths[0], ["diagnostics.objective_injection.sigma=.inf"]).recipe
    f.write_text(recipe_to_yaml(inf))
    assert load_recipe(f).recipe == inf


def test_cpu_kvcache_is_whole_gib_and_the_recipe_wins_over_the_environment(tmp_path):
    from tim_megatron.rollout.vllm_engine import set_cpu_kvcache_env

    p = write(tmp_path, "r.yaml", "{}\n")
    with pytest.raises(RecipeError, match=r"rollout.cpu_kvcache_gib = 1.5.*whole GiB"):
        load_recipe(p, ["rollout.cpu_kvcache_gib=1.5"])
    with pytest.raises(RecipeError, match=r"rollout.cpu_kvcache_gib = 0.5"):
        load_recipe(p, ["rollout.cpu_kvcache_gib=0.5"])
    gib = load_recipe(p, ["rollout.cpu_kvcache_gib=3"]).recipe.rollout.cpu_kvcache_gib
    env = {}
    assert set_cpu_kvcache_env(env, gib=gib) == "" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    env = {"VLLM_CPU_KVCACHE_SPACE": "40"}
    note = set_cpu_kvcache_env(env, gib=gib)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_KVCACHE_SPACE=40" in note and "rollout.cpu_kvcache_gib=3" in note
    assert set_cpu_kvcache_env({"VLLM_CPU_KVCACHE_SPACE": "3"}, gib=gib) == ""


MLA = ["kv_lora_rank=512", "qk_nope_head_dim=32", "qk_rope_head_dim=32", "v_head_dim=32", "qk_norm=none"]
YARN = ["rope_scaling=yarn", "yarn_factor=4.0", "yarn_original_max_position_embeddings=128"]


@pytest.mark.parametrize(
    "recipe, overrides, family, have",
    [
        ("tiny-moe", MLA, "qwen3_moe", "deepseek_v2, deepseek_v3"),
        ("tiny-moe", YARN, "qwen3_moe", "deepseek_v2, deepseek_v3, gpt_oss"),
        ("tiny-glm4-moe", ["router_groups=2"], "glm4_moe", "deepseek_v3"),
    ],
)
def test_a_family_feature_is_refused_for_a_family_without_it(recipe, overrides, family, have):
    """A feature's fields (recipe/dims.py FEATURES) away from their defaults only where the family has the
    feature: another family's layers would ignore them (a qwen3_moe model with a latent rank would be built
    without MLA)."""
    key, value = overrides[0].split("=")
    with pytest.raises(
        RecipeError,
        match=rf"model.dims.{key} = '?{value}'?.*family = {family} does not have \(families with it: {have}\)",
    ):
        load_recipe(ROOT / "recipes" / recipe / "grpo.yaml", [f"model.dims.{o}" for o in overrides])


def test_every_family_feature_is_read_by_its_families():
    """Each family's tiny model and published configs pass the feature check (it runs on every ModelDims), and the
    table names only known families and fields."""
    from tim_megatron.recipe.dims import FEATURES, ModelDims
    from tim_megatron.recipe.schema import FAMILIES

    for f in FEATURES:
        assert set(f.families) <= set(FAMILIES) and set(f.fields) <= set(ModelDims.model_fields)


def test_a_rule_on_the_world_size_sees_the_world_that_nproc_and_nodes_give():
    """Issue 56, bug 9: ``tim train --nproc 2 ... rollout.fault_drill.rank=1`` was refused ("the run has ranks 0 to
    0") unless parallel.dp=2 was also given, although --nproc says parallel.dp follows it: the rules ran on the
    recipe before the world size was known. The same held for ``tim submit --nodes``."""
    from tim_megatron.cli import _load_for_world
    from tim_megatron.slurm.submit import with_nodes

    drill = [
        "rollout.engine_process=true",
        "rollout.fault_drill.kind=kill",
        "rollout.fault_drill.rank=1",
    ]
    tiny = ROOT / "recipes/tiny-moe/grpo.yaml"
    with pytest.raises(RecipeError, match=r"rollout.fault_drill.rank = 1: the run has ranks 0 to 0"):
        _load_for_world(tiny, drill, 1)
    assert _load_for_world(tiny, drill, 2).recipe.parallel.dp == 2
    assert _load_for_world(tiny, [*drill, "parallel.dp=2"], 2).recipe.parallel.dp == 2
    with pytest.raises(RecipeError, match=r"rank = 1: the run has ranks 0 to 0"):  # dp given: it is kept
        _load_for_world(tiny, [*drill, "parallel.dp=1"], 2)
    big = ROOT / "recipes/qwen3-30b-a3b/gspo.yaml"
    c = load_recipe(big).recipe
    last = c.parallel.world_size * 2 - 1  # a rank that only the doubled job has
    on_two = [*drill[:2], f"rollout.fault_drill.rank={last}", "rollout.tensor_parallel_size=1"]
    with pytest.raises(RecipeError, match=rf"rank = {last}: the run has ranks 0 to {last // 2}"):
        with_nodes(big, on_two, None)
    assert with_nodes(big, on_two, c.cluster.nodes * 2).recipe.parallel.world_size == last + 1


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            [
                "rollout.engine_process=true",
                "rollout.fault_drill.kind=kill",
                "rollout.fault_drill.step=30",
                "run.steps=4",
            ],
            r"rollout.fault_drill.step = 30 with run.steps = 4: the drill would never fire",
        ),
        (
            ["rollout.max_staleness=16", "run.steps=4"],
            r"step 1 would sample 17 batches, of which 13 would never",
        ),
        (["rollout.faults.timeout_s=5"], r"rollout.faults is set with rollout.engine_process = false"),
        (
            ["rl.correction.mode=tis", "rl.correction.target=staleness"],
            r"target = staleness with rollout.max_staleness = 0: .*every staleness weight is 1",
        ),
        (
            ["model.tiny_warmup_steps=2147483647"],
            r"model.dims|tiny_warmup_steps.*less than or equal to 20000",
        ),
        (["run.val_samples=1000000"], r"val_samples.*less than or equal to 256"),
        (["run.val_samples=8", "run.val_every=0"], r"run.val_samples = 8 with run.val_every = 0"),
    ],
)
def test_values_that_can_never_take_effect_or_never_end_are_refused_by_name(overrides, refused):
    """Issue 56: each of these loaded in silence and did nothing (a drill past the run, corrections aimed at a part
    that is 0, budgets of an engine process with none) or sized work without bound (a warm-up of 2^31 steps, a
    million samples per validation prompt, batches sampled ahead that are never trained)."""
    with pytest.raises(RecipeError, match=refused):
        load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml", overrides)


def test_latent_attention_and_real_checkpoints_refuse_settings_they_ignore(tmp_path):
    with pytest.raises(RecipeError, match=r"trainer.attention = materialized with latent attention"):
        load_recipe(ROOT / "recipes/tiny-deepseek-v3/grpo.yaml", ["trainer.attention=materialized"])
    load_recipe(ROOT / "recipes/tiny-deepseek-v3/grpo.yaml", ["trainer.attention=sdpa"])
    from tim_megatron.recipe.notices import notices

    real = load_recipe(
        ROOT / "recipes/tiny-moe/grpo.yaml", ["model.path=/x", "model.tiny_warmup_steps=5"]
    ).recipe
    assert notices(real) == [
        "model.tiny_warmup_steps = 5 with model.path = /x: these build the built-in tiny model and do nothing to a "
        "checkpoint"
    ]
    assert notices(load_recipe(ROOT / "recipes/tiny-moe/grpo.yaml").recipe) == []


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            [],
            r"rl.correction.mode = none with rollout.max_staleness = 2: .*set rl.correction.mode = tis, mis or icepop",
        ),
        (
            ["rl.correction.mode=tis", "rl.correction.target=tim"],
            r"rl.proximal = current with rl.correction.target = tim",
        ),
        (["rl.correction.mode=mis", "rl.correction.target=staleness"], r"proximal current is target total"),
        (
            ["rl.correction.mode=tis", "rl.proximal=sampled"],
            r"rl.proximal = sampled with rl.correction.target = total",
        ),
        (
            ["rl.correction.mode=icepop", "rl.proximal=sampled", "rl.correction.target=staleness"],
            r"proximal sampled is target tim",
        ),
    ],
)
def test_an_off_policy_loss_that_is_not_corrected_by_its_own_proximal_policy_is_refused(overrides, refused):
    """Issue 58, item 3: rollout.max_staleness 2 with rl.correction.mode none trained plain PPO around pi_t with no
    pi / mu weight, and all six (rl.proximal, rl.correction.target) pairs loaded, though only (current, total) and
    (sampled, tim) weight the ratio without bias. Each biased combination is refused by name with what to set; the
    two unbiased pairs load, and rl.correction.allow_biased lets a study of the bias run."""
    tiny = ROOT / "recipes/tiny-moe/grpo.yaml"
    lag = ["rollout.max_staleness=2", "run.steps=4"]
    with pytest.raises(RecipeError, match=refused):
        load_recipe(tiny, [*lag, *overrides])
    load_recipe(tiny, [*lag, *overrides, "rl.correction.allow_biased=true"])
    load_recipe(tiny, [*lag, "rl.correction.mode=mis"])  # AReaL's decoupled PPO: current, total, mis
    load_recipe(tiny, [*lag, "rl.correction.mode=tis", "rl.proximal=sampled", "rl.correction.target=tim"])
    if (
        "rl.correction.target=staleness" not in overrides
    ):  # on-policy refused elsewhere: every weight would be 1
        load_recipe(tiny, overrides)  # on-policy every other pair is the same loss
