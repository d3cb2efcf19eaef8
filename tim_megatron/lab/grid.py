"""Grid files: a base recipe, seeds, a fixed data seed and named arms of recipe overrides.

```yaml
name: lab-quick
base_recipe: ../recipes/tiny-moe/countdown.yaml
seeds: [1, 2]
data_seed: 0                  # every arm and seed sees the same prompts in the same order
tune_seeds: [1]               # the early-warning detector is tuned on these and checked on the others
weights: seed                 # seed (default): the tiny model's initial weights follow the run seed; fixed: one set
collapse_window: 10           # steps in the reward mean of the persistent-collapse rule (lab/runstats.py)
collapse_min_steps: 20        # steps a collapse must last to the end of the run (later drops are censored)
order: arm                    # arm (default): an arm's seeds one after another; seed: every arm of a seed first
overrides: [run.steps=24]     # applied to every arm
arms:
  - name: baseline
  - name: tis
    overrides: [rl.correction.mode=tis]
  - name: inject-noise-0.3
    overrides: [diagnostics.vexact=exact, diagnostics.sampling_injection.type=noise,
                diagnostics.sampling_injection.std=0.3]
    group: inject-noise        # optional: a dose series (claim C2) ...
    dose: 0.3                  # ... and this arm's place in it
  - name: future
    requires: a feature this checkout lacks    # optional, see below
    overrides: [diagnostics.some_future_key=on]
contrasts:                    # optional: the primary deficit tests (default: each dose-series arm vs the first arm)
  - {name: noise-cost, arm: inject-noise-0.3, reference: baseline}   # deficit = reference minus arm, by seed
```

An arm whose overrides this checkout's schema rejects is an error, unless it declares ``requires``: then it is
reported as "not run: needs <requires>" (and its claims as inconclusive) until the feature exists; running the
grid again then runs just those arms, since completed runs are reused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tim_megatron.lab.runstats import COLLAPSE_MIN_STEPS
from tim_megatron.recipe.loader import LoadedRecipe, RecipeError, load_recipe, read_yaml_file

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""A grid's or an arm's name; used with ``fullmatch`` (``match`` with ``$`` would pass a trailing newline)."""
GRID_KEYS = {
    "name", "description", "base_recipe", "seeds", "data_seed", "tune_seeds", "overrides", "arms", "weights",
    "collapse_window", "collapse_min_steps", "order", "contrasts",
}  # fmt: skip
ORDERS = ("arm", "seed")
"""``order``: ``arm`` runs an arm's seeds one after another (arm by arm); ``seed`` runs every arm of a seed before
the next seed, so the arms are interleaved in time and a slow stretch of the machine falls on all of them."""
CONTRAST_KEYS = {"name", "arm", "reference"}
WEIGHTS = ("seed", "fixed")
"""``weights``: ``seed`` sets ``model.tiny_seed`` to the run seed (seeds vary the initial weights as well as the
sampling); ``fixed`` keeps the base recipe's tiny_seed (seeds vary only the sampling)."""
ARM_KEYS = {"name", "overrides", "requires", "group", "dose", "description"}


class GridError(ValueError):
    """A grid file that cannot be used; the message names the file, the key and what is allowed."""


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...] = ()
    requires: str | None = None
    """The feature this arm needs; without it in the schema the arm is reported as not run."""
    group: str | None = None
    dose: float | None = None
    description: str = ""


@dataclass(frozen=True)
class Contrast:
    """One primary deficit test: ``reference``'s outcome minus ``arm``'s, paired by seed (> 0: the arm is worse)."""

    name: str
    arm: str
    """The arm whose cost is tested."""
    reference: str
    """The arm it is measured against (the control, or another injected arm)."""


@dataclass
class Grid:
    path: Path
    name: str
    base: Path
    seeds: list[int]
    data_seed: int
    tune_seeds: list[int]
    overrides: list[str]
    arms: list[Arm]
    description: str = ""
    weights: str = "seed"
    """``seed``: the tiny model's initial weights follow the run seed; ``fixed``: every run starts from one set."""
    collapse_window: int = 10
    """Steps in the trailing reward mean of the persistent-collapse rule."""
    collapse_min_steps: int = COLLAPSE_MIN_STEPS
    """Steps a collapse must last, to the end of the run; a drop in the last ``collapse_min_steps - 1`` steps is
    censored (it has no room to be seen persisting)."""
    order: str = "arm"
    """The order runs start in (:data:`ORDERS`)."""
    contrasts: tuple[Contrast, ...] = ()
    """The primary deficit tests (:mod:`tim_megatron.lab.deficits`); empty: each dose-series arm against the
    control."""

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def run_overrides(self, arm: Arm, seed: int) -> list[str]:
        """Every override of one run: the grid's, the arm's, then the seed (and the tiny model's weight seed, with
        ``weights: seed``), the data seed and the name."""
        return [
            *self.overrides,
            *arm.overrides,
            f"run.seed={seed}",
            *([f"model.tiny_seed={seed}"] if self.weights == "seed" else []),
            f"data.seed={self.data_seed}",
            f"run.name={self.name}-{arm.name}",
            "logging.wandb.mode=disabled",
        ]


@dataclass
class ArmPlan:
    arm: Arm
    runnable: bool
    reason: str = ""
    """Why it cannot run (``needs ...``), empty when it can."""
    schema_error: str = ""
    """The first line of the schema's own message for an arm that cannot run."""
    loaded: LoadedRecipe | None = field(default=None, repr=False)


def _fail(path: Path, msg: str) -> GridError:
    return GridError(f"{path}: {msg}")


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer too large for a float
        return False


def _int_list(path: Path, key: str, value, *, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise _fail(
            path, f"{key} = {value!r}: expected a {'' if allow_empty else 'non-empty '}list of integers"
        )
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _fail(path, f"{key} = {value!r}: every entry must be an integer >= 0")
    if len(set(value)) != len(value):
        raise _fail(path, f"{key} = {value!r}: an entry appears twice")
    return list(value)


def _str_list(path: Path, key: str, value) -> list[str]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(path, f"{key} = {value!r}: expected a list of key=value strings")
    return list(value)


def load_grid(path: str | Path) -> Grid:
    path = Path(path)
    if not path.is_file():
        raise GridError(f"{path}: grid file not found (presets live in lab/<preset>.yaml)")
    try:
        data = read_yaml_file(path)
    except RecipeError as e:
        raise GridError(str(e)) from None
    if not isinstance(data, dict):
        raise _fail(path, "a grid file must be a mapping")
    unknown = set(data) - GRID_KEYS
    if unknown:
        raise _fail(path, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(GRID_KEYS)}")
    name = str(data.get("name") or path.stem)
    if not _NAME.fullmatch(name):
        raise _fail(path, f"name = {name!r}: use letters, digits, '.', '_' and '-'")
    base = data.get("base_recipe")
    if not isinstance(base, str):
        raise _fail(path, f"base_recipe = {base!r}: expected a recipe path (relative to the grid file)")
    base_path = Path(base) if Path(base).is_absolute() else path.parent / base
    seeds = _int_list(path, "seeds", data.get("seeds"))
    tune = _int_list(path, "tune_seeds", data.get("tune_seeds", []), allow_empty=True)
    if set(tune) - set(seeds):
        raise _fail(path, f"tune_seeds = {tune}: every tuning seed must be one of seeds = {seeds}")
    data_seed = data.get("data_seed", 0)
    if not isinstance(data_seed, int) or isinstance(data_seed, bool) or data_seed < 0:
        raise _fail(path, f"data_seed = {data_seed!r}: expected an integer >= 0")
    weights = data.get("weights", "seed")
    if weights not in WEIGHTS:
        raise _fail(path, f"weights = {weights!r}: expected one of {list(WEIGHTS)}")
    window = data.get("collapse_window", 10)
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise _fail(path, f"collapse_window = {window!r}: expected an integer >= 2 (steps)")
    min_steps = data.get("collapse_min_steps", COLLAPSE_MIN_STEPS)
    if not isinstance(min_steps, int) or isinstance(min_steps, bool) or min_steps < 1:
        raise _fail(path, f"collapse_min_steps = {min_steps!r}: expected an integer >= 1 (steps)")
    raw = data.get("arms")
    if not isinstance(raw, list) or not raw:
        raise _fail(path, "arms: expected a non-empty list of {name, overrides, ...}")
    arms, seen = [], set()
    for i, a in enumerate(raw):
        if not isinstance(a, dict) or "name" not in a:
            raise _fail(path, f"arms[{i}] = {a!r}: expected a mapping with a name")
        if set(a) - ARM_KEYS:
            raise _fail(
                path, f"arms[{i}]: unknown key(s) {sorted(set(a) - ARM_KEYS)}; allowed: {sorted(ARM_KEYS)}"
            )
        aname = str(a["name"])
        if not _NAME.fullmatch(aname):
            raise _fail(path, f"arms[{i}].name = {aname!r}: use letters, digits, '.', '_' and '-'")
        if aname in seen:
            raise _fail(path, f"arms[{i}].name = {aname!r} is used twice")
        seen.add(aname)
        dose = a.get("dose")
        if dose is not None and (
            isinstance(dose, bool) or not isinstance(dose, int | float) or not _finite(dose)
        ):
            raise _fail(path, f"arms[{i}].dose = {dose!r}: expected a finite number (not .nan or .inf)")
        arms.append(
            Arm(
                name=aname,
                overrides=tuple(_str_list(path, f"arms[{i}].overrides", a.get("overrides"))),
                requires=str(a["requires"]) if a.get("requires") else None,
                group=str(a["group"]) if a.get("group") else None,
                dose=float(dose) if dose is not None else None,
                description=str(a.get("description") or ""),
            )
        )
    order = data.get("order", "arm")
    if order not in ORDERS:
        raise _fail(path, f"order = {order!r}: expected one of {list(ORDERS)}")
    contrasts = _contrasts(path, data.get("contrasts"), [a.name for a in arms])
    return Grid(
        path=path,
        name=name,
        base=base_path,
        seeds=seeds,
        data_seed=data_seed,
        tune_seeds=tune,
        overrides=_str_list(path, "overrides", data.get("overrides")),
        arms=arms,
        description=str(data.get("description") or ""),
        weights=weights,
        collapse_window=window,
        collapse_min_steps=min_steps,
        order=order,
        contrasts=contrasts,
    )


def _contrasts(path: Path, raw, arms: list[str]) -> tuple[Contrast, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise _fail(path, f"contrasts = {raw!r}: expected a non-empty list of {{name, arm, reference}}")
    out, seen = [], set()
    for i, c in enumerate(raw):
        if not isinstance(c, dict) or set(c) != CONTRAST_KEYS:
            raise _fail(
                path,
                f"contrasts[{i}] = {c!r}: expected a mapping with exactly the keys {sorted(CONTRAST_KEYS)}",
            )
        name, arm, ref = (c[k] for k in ("name", "arm", "reference"))
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _fail(path, f"contrasts[{i}].name = {name!r}: use letters, digits, '.', '_' and '-'")
        if name in seen:
            raise _fail(path, f"contrasts[{i}].name = {name!r} is used twice")
        seen.add(name)
        for key, v in (("arm", arm), ("reference", ref)):
            if v not in arms:
                raise _fail(path, f"contrasts[{i}].{key} = {v!r}: not an arm of this grid (arms: {arms})")
        if arm == ref:
            raise _fail(
                path, f"contrasts[{i}]: arm and reference are both {arm!r}; a contrast needs two arms"
            )
        out.append(Contrast(name, arm, ref))
    return tuple(out)


def plan(grid: Grid) -> list[ArmPlan]:
    """Validate every arm against this checkout's schema before anything runs.

    An arm that does not validate is an error (a typo must not silently skip an arm), unless it declares
    ``requires``: then it is planned as not runnable, with the feature and the schema's own message."""
    if not grid.base.is_file():
        raise GridError(f"{grid.path}: base_recipe {grid.base} not found")
    out = []
    for arm in grid.arms:
        try:
            loaded = load_recipe(grid.base, grid.run_overrides(arm, grid.seeds[0]))
        except RecipeError as e:
            if arm.requires is None:
                raise GridError(f"{grid.path}: arm {arm.name!r} does not validate:\n{e}") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            out.append(ArmPlan(arm, False, f"needs {arm.requires}", schema_error=first))
            continue
        out.append(ArmPlan(arm, True, loaded=loaded))
    return out
