"""Render ``launch/tim.sbatch`` from a recipe's ``cluster:`` section.

Safety rules, all enforced here:

* the template is filled in one pass from a dict of finished values: every ``@NAME@`` is replaced once, and
  text a value brings in is never scanned again, so a value that contains ``@OTHER@`` stays literal text;
* values that become ``#SBATCH`` directives (job name, partition, account, QoS, time, memory, the log path)
  must match strict patterns; anything else is rejected with the key, the value and what is allowed;
* values that reach shell lines (run folder, python, container image and mounts, environment values) are
  ``shlex.quote``d as the last step before they go into the dict, and may not hold control characters;
  environment names must be identifiers;
* recipe overrides never reach the script (they are applied in the run folder's ``recipe.yaml``);
* secrets are not rendered: ``WANDB_API_KEY``, ``HF_TOKEN``, ``GITHUB_PAT``, ``DB_PASS``, ``MYSQL_PWD`` and the
  like are refused by name in ``cluster.env``, and any shell value that carries a credential (a URL with
  ``user:password@``, a ``password=`` query, a well-known token format, a private key) is refused by its
  content; secrets pass through the submitting shell's environment instead.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from tim_megatron.recipe.schema import Recipe

TEMPLATE = Path(__file__).resolve().parents[2] / "launch" / "tim.sbatch"
PLACEHOLDER = re.compile(r"@([A-Z][A-Z_]*)@")

SECRET_WORDS = re.compile(
    r"TOKEN|KEY|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION", re.IGNORECASE
)
SECRET_PARTS = re.compile(r"PAT|PW|(?!BYPASS)[A-Z0-9]*PASS|[A-Z0-9]*PWD", re.IGNORECASE)
"""Whole ``_``-separated parts that name a secret (``GITHUB_PAT``, ``DB_PASS``, ``PGPASS``, ``MYSQL_PWD``); as a
substring ``PAT`` would catch ``PATH`` (and ``BYPASS`` is no password)."""
NOT_SECRET_NAMES = frozenset({"PWD", "OLDPWD"})
"""The shell's working-directory variables, which the part rule above would otherwise catch."""
SECRET_VALUES = (
    ("a password in a URL (scheme://user:password@host)", re.compile(r"://[^/?#\s:@]*:[^/?#\s]*@")),
    (
        "a credential in a URL query (password=, token=, key=, ...)",
        re.compile(r"[?&;][^=&;\s]*(?:pass|pwd|token|secret|key|auth|signature)[^=&;\s]*=[^&;\s]", re.I),
    ),
    (
        "an access token (hf_, ghp_, github_pat_, glpat-, sk-, xox?-, AKIA...)",
        re.compile(
            r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
            r"|glpat-[A-Za-z0-9_-]{20,}|sk-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})"
        ),
    ),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a bearer token", re.compile(r"\bBearer\s+\S{8,}", re.I)),
)
"""What a value that carries a credential looks like, whatever its name (``DATABASE_URL=postgres://u:pw@db``)."""

PATTERNS = {
    "cluster.job_name": r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}",
    "cluster.partition": r"[A-Za-z0-9_.,-]{1,100}",
    "cluster.account": r"[A-Za-z0-9_.-]{1,100}",
    "cluster.qos": r"[A-Za-z0-9_.-]{1,100}",
    "cluster.time": r"(\d+-)?\d{1,3}(:\d{2}){0,2}|UNLIMITED|INFINITE",
    "cluster.mem": r"\d+[KMGT]?",
    # Slurm expands %j and friends in --output, sbatch splits directives on whitespace, and pyxis splits
    # mounts on ',' and ':'; so the run folder that goes into them is held to plain path characters.
    "run folder": r"/[A-Za-z0-9._/+=~@-]*",
}
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RenderError(ValueError):
    pass


COMMANDS = ("train", "preflight-job")
"""What a job's ranks run (``tim <command> --run-dir RUN_DIR``): the run itself, or ``tim preflight``'s job."""


FIXES = {"run folder": "set run.output_dir to a folder whose absolute path uses only these characters"}


def _check(key: str, value: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(PATTERNS[key], value):
        raise RenderError(
            f"{key} = {value!r}: not allowed in a Slurm directive (must match {PATTERNS[key]}); "
            f"{FIXES.get(key, f'change {key}')}"
        )
    return value


def _shell(key: str, value: str) -> str:
    """One shell word holding exactly ``value``; a value that carries a credential is refused (unquoted in the
    message: the error must not print the secret either)."""
    what = secret_in_value(value)
    if what is not None:
        env = key.removeprefix("cluster.env.") if key.startswith("cluster.env.") else None
        fix = (
            f"remove it from the recipe and export {env} in the shell that runs `tim submit` (the job inherits it)"
            if env
            else "keep credentials out of the recipe (a registry login belongs in enroot's credentials file)"
        )
        raise RenderError(
            f"{key}: the value holds {what}; secrets must not be written into job scripts: {fix}"
        )
    bad = CONTROL.search(value)
    if bad:
        raise RenderError(
            f"{key} = {value!r}: control character {bad.group()!r} at position {bad.start()} is not allowed "
            "in a job script value; remove it"
        )
    return shlex.quote(value)


def is_secret_name(name: str) -> bool:
    """``WANDB_API_KEY``, ``HF_TOKEN``, ``GITHUB_PAT``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``DB_PASS``,
    ``MYSQL_PWD``..."""
    if name.upper() in NOT_SECRET_NAMES:
        return False
    return bool(SECRET_WORDS.search(name)) or any(SECRET_PARTS.fullmatch(p) for p in name.split("_"))


def secret_in_value(value: str) -> str | None:
    """What kind of credential ``value`` carries, or None."""
    for what, pattern in SECRET_VALUES:
        if pattern.search(value):
            return what
    return None


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


def fill(template: str, values: dict[str, str]) -> str:
    """Replace every ``@NAME@`` of ``template`` by ``values[NAME]`` in a single pass.

    ``re.sub`` never rescans what a replacement inserted, so no value can smuggle in another placeholder.
    A placeholder without a value, or a value without a placeholder, is a bug in the template or here.
    """
    wanted = set(PLACEHOLDER.findall(template))
    if wanted != set(values):
        raise RenderError(
            f"template {TEMPLATE.name} and renderer disagree: placeholders without a value "
            f"{sorted(wanted - set(values))}, values without a placeholder {sorted(set(values) - wanted)}"
        )
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _environment(recipe: Recipe, python: str | None) -> str:
    """``export NAME=<quoted value>`` lines: HF_HOME, the wandb mode, thread counts, cluster.env, PATH."""
    c = recipe.cluster
    env: dict[str, tuple[str, str]] = {}  # name -> (recipe key, value)
    if c.hf_home:
        env["HF_HOME"] = ("cluster.hf_home", c.hf_home)
    mode = recipe.logging.wandb.mode
    if mode in ("offline", "disabled"):
        env["WANDB_MODE"] = ("logging.wandb.mode", mode)
    if not c.gpus_per_node:
        threads = str(c.cpus_per_task // max(procs_per_node(recipe), 1) or 1)
        env["OMP_NUM_THREADS"] = ("cluster.cpus_per_task", threads)
    for k, v in c.env.items():
        if not re.fullmatch(ENV_NAME, k):
            raise RenderError(
                f"cluster.env key {k!r}: not an environment variable name (must match {ENV_NAME})"
            )
        if is_secret_name(k):
            raise RenderError(
                f"cluster.env.{k}: secrets must not be written into job scripts; remove it from the recipe "
                f"and export {k} in the shell that runs `tim submit` (the job inherits it)"
            )
        env[k] = (f"cluster.env.{k}", str(v))
    lines = [f"export {k}={_shell(key, v)}" for k, (key, v) in env.items()]
    if c.venv:
        python, key = str(Path(c.venv) / "bin" / "python"), "cluster.venv"
    elif c.container_image:
        python, key = "python", "cluster.container_image"
    else:
        key = "python"
    py = python or sys.executable
    if "/" in py:
        lines.append(f'export PATH={_shell(key, str(Path(py).parent))}:"$PATH"')
    return "\n".join(lines)


def _container(recipe: Recipe, run_dir: str) -> str:
    """pyxis options for ``srun``; empty without a container image."""
    c = recipe.cluster
    if not c.container_image:
        return ""
    for i, m in enumerate(c.container_mounts):
        if "," in m:
            raise RenderError(
                f"cluster.container_mounts[{i}] = {m!r}: one src:dst per entry (no ','); split it into two entries"
            )
    mounts = ",".join([*c.container_mounts, f"{run_dir}:{run_dir}"])
    return (
        f"--container-image={_shell('cluster.container_image', c.container_image)}"
        f" --container-mounts={_shell('cluster.container_mounts', mounts)}"
        f" --container-workdir={_shell('run folder', run_dir)}"
    )


def values(
    recipe: Recipe, *, run_dir: Path, job_name: str, python: str | None = None, command: str = "train"
) -> dict[str, str]:
    """Every placeholder's finished text: validated (directives, numbers) or shell-quoted (everything else)."""
    c = recipe.cluster
    if command not in COMMANDS:
        raise RenderError(f"job command {command!r}: allowed {', '.join(COMMANDS)}")
    folder = _check("run folder", str(Path(run_dir).resolve()))
    directives = []
    if c.gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={int(c.gpus_per_node)}")
    for key, val, flag in (
        ("cluster.partition", c.partition, "partition"),
        ("cluster.account", c.account, "account"),
        ("cluster.qos", c.qos, "qos"),
    ):
        if val:
            directives.append(f"#SBATCH --{flag}={_check(key, val)}")
    if c.requeue:
        directives.append("#SBATCH --requeue")
    return {
        "JOB_NAME": _check("cluster.job_name", c.job_name or job_name),
        "NODES": str(int(c.nodes)),
        "CPUS": str(int(c.cpus_per_task)),
        "MEM": _check("cluster.mem", c.mem),
        "TIME": _check("cluster.time", c.time),
        "LOG": f"{folder}/logs/slurm-%j.out",
        "SIGNAL_SECONDS": str(int(c.signal_seconds)),
        "OPTIONAL_DIRECTIVES": "\n".join(directives),
        "RUN_DIR": _shell("run folder", folder),
        "PROCS_PER_NODE": str(int(procs_per_node(recipe))),
        "REQUEUE": "1" if c.requeue else "0",
        "ENVIRONMENT": _environment(recipe, python),
        "SRUN_CONTAINER": _container(recipe, folder),
        "HOST_PYTHON": _host_python(recipe, python),
        "COMMAND": command,
    }


def _host_python(recipe: Recipe, python: str | None) -> str:
    """The python the batch script itself runs (on the first node, outside any container) to read ``run.json``:
    the job's own where the script's ``PATH`` leads to it, the submitting one (``sys.executable``) for a container
    job, whose python lives inside the image."""
    c = recipe.cluster
    if c.container_image and not c.venv:
        return _shell("python", python or sys.executable)
    return "python"


def render(
    recipe: Recipe, *, run_dir: Path, job_name: str, python: str | None = None, command: str = "train"
) -> str:
    return fill(
        TEMPLATE.read_text(),
        values(recipe, run_dir=run_dir, job_name=job_name, python=python, command=command),
    )
