"""What a preflight job runs: the recipe's own layout with its workload shrunk, as one visible list of overrides.

Everything that decides whether the job can run stays as the recipe has it: nodes, GPUs per node and their
type, partition, container, environment, the TP/EP/DP layout, rollout engines (``rollout.tensor_parallel_size``),
dtypes, remedies, R3 capture, sleep settings and the real ``model.path``. Only the amount of work shrinks, and
only through :func:`shrink_list`, whose entries (key, value, why) are saved in ``preflight.json``. A key the user
sets on the command line is left as given (and listed as kept).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tim_megatron.modes import modes_of
from tim_megatron.recipe import LoadedRecipe
from tim_megatron.recipe.loader import OVERRIDE_SOURCE

PREFLIGHT_STEPS = 2
"""Two loop steps: the second shows steady-state times and checks the first sync on its own samples."""
PREFLIGHT_N = 2
"""Samples per prompt (the GRPO group needs two to have an advantage)."""
PREFLIGHT_MAX_TOKENS = 32
"""Generation budget per response (never more than the recipe's)."""
PREFLIGHT_TIME = "01:00:00"
"""The job's wall-time limit (or the recipe's, when shorter)."""
NAME_SUFFIX = "-preflight"


@dataclass(frozen=True)
class Shrink:
    key: str
    value: object
    why: str

    @property
    def override(self) -> str:
        return f"{self.key}={json.dumps(self.value)}"  # JSON is YAML: strings stay strings


def slurm_minutes(text: str) -> float:
    """A Slurm time limit in minutes: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``; unlimited = inf."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return math.inf
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = [*parts, 0, 0][:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, [*parts, 0][:2]
    return int(days or 0) * 1440 + h * 60 + m + s / 60


def preflight_prompts(*, engines: int, dp: int, n: int, minibatches: int) -> int:
    """The fewest prompts per step that give every engine one and split evenly: a multiple of ``dp`` (each data-
    parallel rank trains whole groups) whose ``n`` samples split into ``minibatches`` minibatches over ``dp``."""
    p = max(engines, dp)
    while p % dp or (p * n) % (minibatches * dp):
        p += 1
    return p


def ranks_per_engine(recipe) -> int:
    """R: the ranks of one rollout engine (vLLM's TP size; the trainer's TP size for the exact sampler, whose
    engines are the data-parallel ranks)."""
    return recipe.parallel.tp if modes_of(recipe).exact else recipe.rollout.tensor_parallel_size


def shrink_list(loaded: LoadedRecipe) -> tuple[list[Shrink], list[str]]:
    """The overrides that shrink ``loaded``'s workload, and the keys left as the command line gave them."""
    r = loaded.recipe
    p = r.parallel
    engines = p.world_size // ranks_per_engine(r)
    n = min(PREFLIGHT_N, r.rollout.n)
    prompts = preflight_prompts(engines=engines, dp=p.dp, n=n, minibatches=r.rl.minibatches)
    time = PREFLIGHT_TIME if slurm_minutes(r.cluster.time) > slurm_minutes(PREFLIGHT_TIME) else r.cluster.time
    items = [
        Shrink("run.steps", PREFLIGHT_STEPS, "two real loop steps; the second is the one timed"),
        Shrink("run.val_every", 0, "no validation"),
        Shrink("checkpoint.every", 0, "no checkpoint between the steps"),
        Shrink(
            "checkpoint.save_optimizer",
            False,
            "the loop's final checkpoint is written (the real path) without optimizer state, then deleted",
        ),
        Shrink("cluster.requeue", False, "a preflight is not resumed"),
        Shrink("cluster.time", time, "a short job (the phases have their own timeouts)"),
        Shrink("run.name", f"{loaded.name}{NAME_SUFFIX}", "its own run folder"),
        Shrink(
            "data.prompts_per_step",
            prompts,
            f"one prompt per engine ({engines}), lifted to split over dp = {p.dp} and rl.minibatches = "
            f"{r.rl.minibatches}",
        ),
        Shrink("rollout.n", n, "two samples per prompt"),
        Shrink("rollout.max_tokens", min(PREFLIGHT_MAX_TOKENS, r.rollout.max_tokens), "short responses"),
        Shrink("rollout.sync_check", "every", "every sync verified (probe and next step's samples)"),
        Shrink("logging.wandb.mode", "offline", "no wandb server needed"),
        Shrink("diagnostics.dumps.every", 0, "no token dumps"),
    ]
    given = {k for k, src in loaded.provenance.items() if src == OVERRIDE_SOURCE}
    kept = [s.key for s in items if s.key in given]
    return [s for s in items if s.key not in given], kept


@dataclass
class Preflight:
    """The recipe as given (``full``), the recipe the job runs (``shrunk``), and what changed between them."""

    full: LoadedRecipe
    shrunk: LoadedRecipe
    shrink: list[Shrink]
    kept: list[str]
    """Shrink keys the command line set itself (its values are used)."""
    nodes: int | None

    def request(self) -> dict:
        """What the job needs to know beyond its recipe (saved as ``preflight/request.json``)."""
        from tim_megatron.preflight.extrapolate import memory_plan, step_shape
        from tim_megatron.preflight.heartbeat import TIMEOUTS

        return {
            "recipe": str(self.full.path),
            "name": self.full.name,
            "overrides": self.full.overrides,
            "nodes": self.nodes,
            "shrink": [asdict(s) for s in self.shrink],
            "kept": self.kept,
            "layout": layout(self.shrunk),
            "shape": {"preflight": step_shape(self.shrunk.recipe), "full": step_shape(self.full.recipe)},
            "memory_plan": memory_plan(full=self.full.recipe, shrunk=self.shrunk.recipe),
            "timeouts": dict(TIMEOUTS),
        }


def load_preflight(
    recipe: str | Path, overrides: list[str] | None = None, nodes: int | None = None
) -> Preflight:
    """The recipe with the user's overrides (and ``nodes``), then shrunk; raises RecipeError naming the key."""
    from tim_megatron.slurm.submit import with_nodes

    ov = list(overrides or [])
    full = with_nodes(recipe, ov, nodes)
    shrink, kept = shrink_list(full)
    shrunk = with_nodes(recipe, [*ov, *(s.override for s in shrink)], nodes)
    return Preflight(full=full, shrunk=shrunk, shrink=shrink, kept=kept, nodes=nodes)


def layout(loaded: LoadedRecipe) -> dict:
    """The job's layout, as the judge checks it."""
    from tim_megatron.slurm.render import procs_per_node

    r = loaded.recipe
    p, c = r.parallel, r.cluster
    R = ranks_per_engine(r)
    return {
        "nodes": c.nodes,
        "gpus_per_node": c.gpus_per_node,
        "gpu_type": c.gpu_type if c.gpus_per_node else None,
        "procs_per_node": procs_per_node(r),
        "world": p.world_size,
        "tp": p.tp,
        "ep": p.ep,
        "etp": p.etp,
        "pp": p.pp,
        "dp": p.dp,
        "engines": p.world_size // R,
        "ranks_per_engine": R,
        "backend": "nccl" if c.gpus_per_node else "gloo",
        "trainer_dtype": r.trainer_dtype,
        "rollout_dtype": r.rollout_dtype,
        "partition": c.partition,
        "container_image": c.container_image,
        "model": r.model.path,
    }
