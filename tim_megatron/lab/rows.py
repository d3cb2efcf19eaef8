"""A run's metrics rows as the lab reads them: every value the lab's numbers read is a number, or it is left out.

``metrics.jsonl`` may come from anywhere (an archive, a root from elsewhere), and :mod:`.runstats` reads some keys
as numbers without asking (a bucket's token count is summed, ``val/policy_reward_start`` goes through
``float``): one string there would end the whole report in a traceback. :func:`checked_rows` reads the rows and,
for every key the lab reads (:func:`read_by_lab`), keeps a number, reads the tracker's own spellings of values no
JSON number holds (``null`` for NaN, ``"inf"``/``"-inf"``), and leaves out anything else (a string, a list, an
object, true/false) with a notice naming the run, the step and the key. :func:`checked_run` gives
:func:`~tim_megatron.lab.runstats.run_stats` such a run through a copy of its folder with the checked rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
from pathlib import Path

from tim_megatron import metric_names as names
from tim_megatron.lab import runstats
from tim_megatron.run_dir import RECIPE_FILE
from tim_megatron.safe_files import copy_regular, regular_file, write_atomic
from tim_megatron.untrusted import shown

NOTICES_PER_RUN = 5
"""Wrong-typed values named per run (the rest are counted)."""
_READ = frozenset(
    {
        runstats.MISMATCH,
        runstats.PPL_DIFF,
        runstats.PPL_DIFF_TOKEN,
        runstats.DOSE,
        names.REWARD,
        names.RESPONSE_LENGTH,
        names.VAL_ACCURACY,
        names.VAL_POLICY_REWARD,
        names.LR,
        "objective/J",
        "val/policy_reward_start",
        "response/entropy_mean",
        "actor/grad_norm",
        runstats.P + "inv_rho_mean",
    }
    | {
        f"{runstats.P}bucket/{b}/{k}"
        for b in (*runstats.LOW_BUCKETS, runstats.HIGH_BUCKET)
        for k in ("count", "rho_mean")
    }
)
_SPELLED = {"inf": math.inf, "-inf": -math.inf}
"""The tracker's spellings of the infinities (:func:`tim_megatron.logging.tracker._clean`)."""
_FLOAT_KEYS = {"val/policy_reward_start"}
"""Keys read through ``float()``: there a ``null`` (NaN) is left out, which the reader takes for NaN."""


def read_by_lab(key: str) -> bool:
    """Whether the lab's statistics or curves read ``key`` as a number."""
    return key in _READ


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def checked_rows(path: Path, *, run: str) -> tuple[list[dict], list[str], bool]:
    """(rows, notices, changed): the run's rows with every value the lab reads a number (or ``null`` where the
    reader takes ``null``), the notices for the values left out, and whether any row differs from the file's."""
    rows = runstats.run_rows(path)
    bad: list[str] = []
    changed = False
    for row in rows:
        for key in [k for k in row if read_by_lab(k)]:
            v = row[key]
            if _number(v):
                continue
            if v is None and key not in _FLOAT_KEYS:
                continue  # NaN, as the tracker writes it; the readers take None
            changed = True
            if v is None:
                del row[key]
            elif isinstance(v, str) and v in _SPELLED:
                row[key] = _SPELLED[v]
            else:
                del row[key]
                bad.append(f"step {row['step']}: {shown(key, 60)} = {shown(v, 40)}")
    notices = []
    if bad:
        more = f" (and {len(bad) - NOTICES_PER_RUN} more)" if len(bad) > NOTICES_PER_RUN else ""
        notices.append(
            f"run {run}: metrics.jsonl holds {len(bad)} value(s) that are not numbers where the lab reads a "
            f"number, left out of its statistics and curves: {'; '.join(bad[:NOTICES_PER_RUN])}{more}"
        )
    return rows, notices, changed


def checked_run(
    d: Path, *, arm: str, seed: int, window: int, min_steps: int
) -> tuple[runstats.RunStats, list[str]]:
    """:func:`~tim_megatron.lab.runstats.run_stats` of run folder ``d`` on its checked rows, and the notices. A run
    whose rows need no change is read where it is; another through a temporary copy of the files run_stats reads
    (the checked ``metrics.jsonl``, ``run.json``, ``recipe.yaml``), its path then set back to ``d``."""
    rows, notices, changed = checked_rows(d, run=f"{arm}/seed{seed}")
    if not changed:
        return runstats.run_stats(d, arm=arm, seed=seed, window=window, min_steps=min_steps), notices
    with tempfile.TemporaryDirectory(prefix="tim-lab-rows-") as tmp:
        copy = Path(tmp)
        write_atomic(
            copy / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows), what="checked metrics"
        )
        for name in ("run.json", RECIPE_FILE):
            if regular_file(d / name):
                with contextlib.suppress(OSError):
                    copy_regular(d / name, copy / name, src_root=d, what="run file", max_bytes=16 << 20)
        stats = runstats.run_stats(copy, arm=arm, seed=seed, window=window, min_steps=min_steps)
    return dataclasses.replace(stats, path=str(d)), notices
