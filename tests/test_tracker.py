"""The metrics tracker's wandb side: quiet, offline, and nothing printed that the run did not ask for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import openai  # noqa: F401 - vLLM imports it in every run, which is what wandb reacts to
from tim_megatron.logging.tracker import Tracker
from tim_megatron.recipe import load_recipe
from pathlib import Path
r = load_recipe(None, ["logging.wandb.mode=offline"]).recipe
t = Tracker(r, run_dir=Path(sys.argv[1]), name="quiet", run_id="quiet01")
t.log(1, {"reward/mean": 0.5})
t.close()
print("WANDB_DISABLE_WEAVE" in __import__("os").environ)
"""


def test_wandb_prints_no_integration_or_weave_advertisement(tmp_path):
    """wandb 0.19+ prints "Detected [openai] in use" and a Weave advertisement at init when openai is imported
    (it always is, through vLLM). The tracker switches that integration off for its init, and only then."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "Detected [" not in out and "Weave" not in out and "weave" not in out, out[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"  # the switch did not outlive wandb.init
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # wandb did run, offline
