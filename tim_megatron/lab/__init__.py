"""``tim lab``: the papers' causal claims on the tiny MoE, with seeds, confidence intervals and verdicts.

A grid file (``lab/*.yaml``) names a base recipe, seeds, a fixed data seed and arms (each a list of recipe
overrides). ``tim lab GRID`` runs every (arm, seed) through the real ``tim train`` in a subprocess, one at a
time, then aggregates: per-run statistics (:mod:`.runstats`), per-claim verdicts by rules written in
:mod:`.claims`, the early-warning evaluation (:mod:`.detectors`) and the HTML report (:mod:`.report`).

* :mod:`.grid`: the grid file, and which arms can run with this checkout's recipe schema;
* :mod:`.runner`: the runs (sequential; a completed run with the same overrides is reused);
* :mod:`.stats`: t intervals across seeds, paired differences, Wilson intervals.
"""
