"""The names of the metrics that more than one module reads: the console line and the summary
(``logging/``), the report (``report/``), the lab's report, and the recipe's early warning and LR schedule.

Each is written once by the step (``rl/phases.py`` and the ``algo/`` functions it calls, which build the names from
their prefixes); a test checks that a real step's metrics carry every name here. This module imports nothing."""

REWARD = "reward/mean"
"""Mean training reward of the step's samples."""
VAL_ACCURACY = "val/accuracy"
"""Greedy validation accuracy."""
VAL_POLICY_REWARD = "val/policy_reward"
"""Mean reward of ``run.val_samples`` samples per validation prompt from the trained policy, without an injection."""
RESPONSE_LENGTH = "response/length_mean"
"""Mean response length in tokens."""
RHO_STD = "mismatch/old_vs_rollout/rho_std"
"""Std of rho = pi_old / pi_rollout over the sampled tokens: the mismatch."""
LOG_PPL_TOKEN = "mismatch/old_vs_rollout/log_ppl_abs_diff_token_mean"
"""TIM-LR's log-perplexity difference with per-sequence means (comparable across lengths)."""
PROB_PEARSON = "mismatch/old_vs_rollout/prob_pearson"
"""Pearson correlation of pi_old and pi_rollout."""
CLIP_HIGH = "actor/clipfrac_token_high"
"""Share of tokens clipped at the upper bound."""
LR = "actor/lr"
"""The step's learning rate."""
STEP_SECONDS = "time/step"
"""Wall seconds of the step."""
