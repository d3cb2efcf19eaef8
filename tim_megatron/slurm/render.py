"""Render ``launch/tim.sbatch`` from a recipe's ``cluster:`` section.

Safety rules, all enforced here:

* values that become ``#SBATCH`` directives (job name, partition, account, QoS, time, memory) must match
  strict patterns; anything else is rejected with the key and the value;
* values that reach shell lines (run folder, python, container image and mounts, environment values)
  are ``shlex.quote``d; environment names must be identifiers;
* recipe overrides never reach the script (they are applied in the run folder's ``recipe.yaml``);
* secrets are not rendered: ``WANDB_API_KEY``, ``HF_TOKEN`` and the like are refused in ``cluster.env``
  and pass through the submitting shell's environment instead.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from tim_megatron.recipe.schema import Recipe

TEMPLATE = Path(__file__).resolve().parents[2] / "launch" / "tim.sbatch"
SECRET_NAMES = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD)", re.IGNORECASE)

PATTERNS = {
    "cluster.job_name": r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}",
    "cluster.partition": r"[A-Za-z0-9_.,-]{1,100}",
    "cluster.account": r"[A-Za-z0-9_.-]{1,100}",
    "cluster.qos": r"[A-Za-z0-9_.-]{1,100}",
    "cluster.time": r"(\d+-)?\d{1,3}(:\d{2}){0,2}|UNLIMITED|INFINITE",
    "cluster.mem": r"\d+[KMGT]?",
}


class RenderError(ValueError):
    pass


def _check(key: str, value: str) -> str:
    if not re.fullmatch(PATTERNS[key], value):
        raise RenderError(f"{key} = {value!r}: not allowed in a Slurm directive (must match {PATTERNS[key]})")
    return value


def procs_per_node(recipe: Recipe) -> int:
    c, world = recipe.cluster, recipe.parallel.world_size
    if world % c.nodes:
        raise RenderError(
            f"parallel.tp x pp x dp = {world} ranks do not split evenly over cluster.nodes = {c.nodes}"
        )
    per = world // c.nodes
    if c.gpus_per_node and per != c.gpus_per_node:
        raise RenderError(
            f"{world} ranks over cluster.nodes = {c.nodes} is {per} per node, but cluster.gpus_per_node = {c.gpus_per_node} "
            f"(set parallel.dp so that tp x pp x dp = nodes x gpus_per_node = {c.nodes * c.gpus_per_node})"
        )
    return per


def render(recipe: Recipe, *, run_dir: Path, job_name: str, python: str | None = None) -> str:
    c = recipe.cluster
    run_dir = Path(run_dir).resolve()
    name = _check("cluster.job_name", c.job_name or job_name)
    directives = []
    if c.gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    for key, val, flag in (
        ("cluster.partition", c.partition, "partition"),
        ("cluster.account", c.account, "account"),
        ("cluster.qos", c.qos, "qos"),
    ):
        if val:
            directives.append(f"#SBATCH --{flag}={_check(key, val)}")
    if c.requeue:
        directives.append("#SBATCH --requeue")
    env = {}
    if c.hf_home:
        env["HF_HOME"] = c.hf_home
    mode = recipe.logging.wandb.mode
    if mode in ("offline", "disabled"):
        env["WANDB_MODE"] = mode
    if not c.gpus_per_node:
        env.setdefault("OMP_NUM_THREADS", str(c.cpus_per_task // max(procs_per_node(recipe), 1) or 1))
    for k, v in c.env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise RenderError(f"cluster.env key {k!r}: not an environment variable name")
        if SECRET_NAMES.search(k):
            raise RenderError(
                f"cluster.env.{k}: secrets must not be written into job scripts; export it in the submitting shell"
            )
        env[k] = str(v)
    env_lines = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    if c.venv:
        python = str(Path(c.venv) / "bin" / "python")
    elif c.container_image:
        python = "python"
    py = python or sys.executable
    env_lines += f'\nexport PATH={shlex.quote(str(Path(py).parent))}:"$PATH"' if "/" in py else ""
    container = ""
    if c.container_image:
        container = f"--container-image={shlex.quote(c.container_image)}"
        mounts = [*c.container_mounts, f"{run_dir}:{run_dir}"]
        for m in mounts:
            if "," in m:
                raise RenderError(f"cluster.container_mounts entry {m!r}: one src:dst per entry")
        container += f" --container-mounts={shlex.quote(','.join(mounts))} --container-workdir={shlex.quote(str(run_dir))}"
    text = TEMPLATE.read_text()
    values = {
        "@JOB_NAME@": name,
        "@NODES@": str(int(c.nodes)),
        "@CPUS@": str(int(c.cpus_per_task)),
        "@MEM@": _check("cluster.mem", c.mem),
        "@TIME@": _check("cluster.time", c.time),
        "@LOG@": str(run_dir / "logs" / "slurm-%j.out"),
        "@SIGNAL_SECONDS@": str(int(c.signal_seconds)),
        "@OPTIONAL_DIRECTIVES@": "\n".join(directives),
        "@RUN_DIR@": shlex.quote(str(run_dir)),
        "@PROCS_PER_NODE@": str(procs_per_node(recipe)),
        "@REQUEUE@": "1" if c.requeue else "0",
        "@ENVIRONMENT@": env_lines,
        "@SRUN_CONTAINER@": container,
    }
    if re.search(r"\s", str(run_dir / "logs")):
        raise RenderError(f"run folder {run_dir}: Slurm's --output cannot take a path with spaces")
    for k, v in values.items():
        text = text.replace(k, v)
    return text
