"""Were the rules a report decides by in place before its runs started? Judged by the rule files' content.

A report that says its rules were "fixed before any run" must be able to show it. The rules are the content of
:data:`RULE_FILES`, and :func:`rules_fixed_text` judges each file on the best evidence the runs left, run by run:

1. **the hash a run recorded** (:func:`rule_hashes`, written into ``lab.json`` by the lab as the run starts):
   today's content is the one the run started under exactly when the sha256 is equal; no git, no clock;
2. **the commit a run recorded** (``run.json``'s ``code.commit``, with ``code.clean`` true): the file's blob at
   that commit against today's (``git hash-object``); the commit must be in this repository;
3. otherwise (runs from before either record), **git history**: the latest commit that gave the file its current
   content (content equality along the history, so a rebase that kept the content does not move it), dated by
   its *author* date (which a rebase keeps; the committer date is named too when it falls after the start),
   against the first start among those runs (``run.json``'s ``created``, read by
   :func:`tim_megatron.clock.epoch_of`: an aware time as written, a zone-less one as UTC). A start outside
   2000-01-01 to now is not a start (it is left out and said). This needs the full history: a shallow clone, a
   folder that is no git checkout, or git's own refusal ("dubious ownership") makes it "cannot be stated", with
   git's reason.

The sentence names the files whose content was in place before every run, those it was not (and why), and
those it cannot state; every time in it is UTC, named.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tim_megatron import clock
from tim_megatron.lab.checkout import GitAnswer, RunCode, git
from tim_megatron.safe_files import UnsafePathError, read_bytes
from tim_megatron.untrusted import shown

ROOT = Path(__file__).resolve().parents[2]
RULE_FILES = (
    "tim_megatron/lab/claims.py",
    "tim_megatron/lab/runstats.py",
    "tim_megatron/lab/deficits.py",
    "tim_megatron/lab/stats.py",
    "tim_megatron/lab/grid.py",
    "tim_megatron/lab/detectors.py",
    "tim_megatron/algo/early_warning.py",
    "tim_megatron/warning_defaults.py",
    "tim_megatron/logging/summary.py",
)
"""The code that decides the verdicts: the claims' rules, the per-run numbers they read (collapse, growth, the
policy outcome), the per-arm deficits, the statistics, the grid's rule keys, the early-warning detectors
(C8's surge, C8/C9's onset, the detectors table) with their evaluation, the detectors' default settings and the
series every per-run number is read from."""
MAX_RULE_FILE_BYTES = 4 << 20
EARLIEST_START = 946684800.0
"""2000-01-01 00:00 UTC: a recorded start before it (year 1, the epoch) is not taken for a run's start."""


def rule_hashes(repo: Path = ROOT, files: tuple[str, ...] = RULE_FILES) -> dict[str, str | None]:
    """sha256 of each rule file's bytes as it is now (None: missing or not a regular file), for ``lab.json``."""
    out: dict[str, str | None] = {}
    for f in files:
        try:
            out[f] = hashlib.sha256(
                read_bytes(repo / f, what="rule file", max_bytes=MAX_RULE_FILE_BYTES)
            ).hexdigest()
        except (OSError, UnsafePathError):
            out[f] = None
    return out


def _hex64(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


@dataclass(frozen=True)
class RunRules:
    """What one run recorded about the rules it started under."""

    name: str
    """``arm/seedN``."""
    created: object = None
    """``run.json``'s ``created`` as recorded (any type: it is read by :func:`tim_megatron.clock.epoch_of`)."""
    hashes: dict[str, str] = field(default_factory=dict)
    """``lab.json``'s ``rules``: rule file -> sha256 at the run's start (only well-formed entries)."""
    codes: tuple[RunCode, ...] = ()
    """``run.json``'s ``code`` records (:func:`tim_megatron.lab.checkout.run_code`)."""

    @staticmethod
    def of(name: str, *, lab: dict, meta: dict, codes: list[RunCode]) -> RunRules:
        rules = lab.get("rules") if isinstance(lab, dict) else None
        hashes = (
            {k: v for k, v in rules.items() if isinstance(k, str) and _hex64(v)}
            if isinstance(rules, dict)
            else {}
        )
        return RunRules(name=name, created=meta.get("created"), hashes=hashes, codes=tuple(codes))

    def clean_commits(self) -> list[str] | None:
        """The commits of every recorded attempt, when each was a clean tree; None otherwise."""
        if not self.codes or any(c.commit is None or c.clean is not True for c in self.codes):
            return None
        return list(dict.fromkeys(c.commit for c in self.codes))


@dataclass
class _Verdict:
    file: str
    changed: list[str] = field(default_factory=list)
    """Why its content was not the one some run started with."""
    unknown: list[str] = field(default_factory=list)
    """Why that cannot be stated for some runs."""
    notes: list[str] = field(default_factory=list)
    history: tuple[str, float, float] | None = None
    """(commit, author epoch, committer epoch) of the commit that gave it its current content (rule 3)."""

    @property
    def state(self) -> str:
        return "changed" if self.changed else "unknown" if self.unknown else "fixed"


class _Repo:
    """git answers for one report, each asked once."""

    def __init__(self, repo: Path):
        self.repo = repo
        self._cache: dict[tuple[str, ...], GitAnswer] = {}

    def ask(self, *args: str) -> GitAnswer:
        if args not in self._cache:
            self._cache[args] = git(self.repo, *args)
        return self._cache[args]

    def blob_now(self, f: str) -> str | None:
        a = self.ask("hash-object", "--", f)
        return a.text if a.ok else None

    def blob_at(self, commit: str, f: str) -> GitAnswer:
        return self.ask("rev-parse", "--verify", "--quiet", f"{commit}:{f}")

    def history_refusal(self) -> str | None:
        """Why git history cannot date content here (None: it can)."""
        a = self.ask("rev-parse", "--is-shallow-repository")
        if not a.ok:
            return f"git refuses to read {self.repo}: {a.why}"
        if a.text == "true":
            return (
                f"{self.repo} is a shallow clone (git rev-parse --is-shallow-repository), whose history is cut, so "
                "when the rules' content first appeared is not in it"
            )
        return None

    def introduced(self, f: str, blob: str) -> tuple[str, float, float] | None:
        """The latest commit along HEAD's history that gave ``f`` the content ``blob``: (id, author, committer)."""
        a = self.ask(
            "log", "--topo-order", "--diff-merges=first-parent", "--no-renames", "--raw", "--no-abbrev",
            "--format=%x00%H %at %ct", "--", f,
        )  # fmt: skip
        if not a.ok:
            return None
        for chunk in a.text.split("\x00"):
            lines = chunk.strip().splitlines()
            if not lines:
                continue
            head = lines[0].split()
            for line in lines[1:]:
                fields = line.split("\t")[0].split()
                if len(fields) >= 4 and fields[3] == blob and len(head) == 3:
                    return head[0], float(head[1]), float(head[2])
        return None


def _and(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _short(files: list[str]) -> str:
    """Base names where they are unique among the rule files, as a list."""
    base = [os.path.basename(f) for f in RULE_FILES]
    return _and([f if base.count(os.path.basename(f)) > 1 else os.path.basename(f) for f in files])


def _where(files: tuple[str, ...]) -> str:
    """``claims.py and runstats.py in tim_megatron/lab/ and early_warning.py in tim_megatron/algo/``."""
    by_dir: dict[str, list[str]] = {}
    for f in files:
        by_dir.setdefault(os.path.dirname(f) or ".", []).append(os.path.basename(f))
    return _and([f"{_and(names)} in {d}/" for d, names in by_dir.items()])


def _runs(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _unknown(v: _Verdict, why: str) -> None:
    v.unknown.append(why)


def _by_record(v: _Verdict, f: str, now_sha: str, runs: list[RunRules], g: _Repo) -> list[RunRules]:
    """Rules 1 and 2 for file ``f``; returns the runs that recorded neither (for rule 3)."""
    differ: list[str] = []
    by_commit: dict[str, list[str]] = {}
    rest = []
    for r in runs:
        commits = r.clean_commits()
        if f in r.hashes:
            if r.hashes[f] != now_sha:
                differ.append(r.name)
        elif commits is not None:
            for c in commits:
                by_commit.setdefault(c, []).append(r.name)
        else:
            rest.append(r)
    if differ:
        v.changed.append(
            f"{{differs}} from the sha256 that {len(differ)} run(s) recorded as they started ({_runs(differ)})"
        )
    for c, names in by_commit.items():
        now_blob, then = g.blob_now(f), g.blob_at(c, f)
        if now_blob is None:
            _unknown(v, f"git cannot hash the file ({g.ask('hash-object', '--', f).why})")
        elif not then.ok:
            why = then.why or f"commit {c[:12]} or the file in it is not in {g.repo}"
            _unknown(
                v, f"the content at commit {c[:12]}, which {_runs(names)} ran from, cannot be read ({why})"
            )
        elif then.text != now_blob:
            v.changed.append(
                f"{{differs}} from {{its}} content at commit {c[:12]}, which {_runs(names)} ran from"
            )
    return rest


def _by_history(v: _Verdict, f: str, first: float, g: _Repo) -> None:
    """Rule 3 for file ``f``: the commit that gave it its current content, by author date, against ``first``."""
    refusal = g.history_refusal()
    if refusal:
        return _unknown(v, refusal)
    blob = g.blob_now(f)
    if blob is None:
        return _unknown(v, f"git cannot hash the file ({g.ask('hash-object', '--', f).why})")
    dirty = g.ask("status", "--porcelain", "--", f)
    if not dirty.ok:
        return _unknown(v, f"git refuses to read {g.repo}: {dirty.why}")
    if dirty.text:
        return _unknown(
            v, "this checkout has uncommitted changes to it, so no commit dates the current content"
        )
    intro = g.introduced(f, blob)
    if intro is None:
        return _unknown(v, "no commit in this checkout's history has the current content")
    v.history = intro
    commit, authored, committed = intro
    if authored >= first:
        v.changed.append(
            f"{{has}} {{its}} current content only since commit {commit[:7]}, authored {clock.shown(authored)}, after that "
            "start"
        )
    elif committed >= first:
        v.notes.append(
            f"commit {commit[:7]} was authored before that start and committed after it, "
            f"{clock.shown(committed)} (a rebase or cherry-pick keeps the author date)"
        )


def rules_fixed_text(
    *, runs: list[RunRules], repo: Path = ROOT, files: tuple[str, ...] = RULE_FILES, now: float | None = None
) -> str:
    """The report's sentence on whether the rules were in place before its runs (see the module docstring)."""
    what = f"The rules are the content of {_where(files)}."
    if not runs:
        return f"{what} No completed run is in this report to compare them with."
    now = time.time() if now is None else now
    g = _Repo(repo)
    current = rule_hashes(repo, files)
    verdicts = {f: _Verdict(f) for f in files}
    legacy: dict[str, list[RunRules]] = {}
    for f, v in verdicts.items():
        if current[f] is None:
            _unknown(v, f"not a regular file in {repo}")
        else:
            legacy[f] = _by_record(v, f, current[f], runs, g)
    old = {r.name: r for rs in legacy.values() for r in rs}
    starts, implausible = {}, []
    for name, r in sorted(old.items()):
        at = clock.epoch_of(r.created)
        if at is not None and EARLIEST_START <= at <= now:
            starts[name] = at
        else:
            implausible.append(f"{name} ({'none' if r.created is None else shown(r.created, 40)})")
    first = min(starts.values()) if starts else None
    for f, rs in legacy.items():
        if rs and first is None:
            _unknown(verdicts[f], "no run that recorded neither hash nor commit recorded a plausible start")
        elif rs:
            _by_history(verdicts[f], f, first, g)
    hashed = sum(bool(r.hashes) for r in runs)
    committed = sum(not r.hashes and r.clean_commits() is not None for r in runs)
    start = (
        f"{clock.shown(first)} (run.json's created; a zone-less time is read as UTC)"
        if first is not None
        else ""
    )
    dating = "git history dates the rules' current content, by author date (which a rebase keeps), against "
    left_out = (
        f"; {len(implausible)} run(s) recorded no plausible start (2000 to now) and are left out of that "
        f"comparison: {_runs(implausible)}"
        if implausible
        else ""
    )
    if not old:
        lead = [f"{hashed} of the {len(runs)} runs recorded the rules' sha256 as they started (lab.json)"]
        if hashed == len(runs):
            lead = [f"Every one of the {len(runs)} runs recorded the rules' sha256 as it started (lab.json)"]
        if committed:
            lead.append(f"{committed} the clean commit they ran from (run.json's code)")
    elif not hashed and not committed:
        who = (
            f"None of the {len(runs)} runs recorded the rules' sha256 as it started (lab.json) or a clean commit it "
            "ran from (run.json)"
            if len(runs) > 1
            else "The one run recorded neither the rules' sha256 as it started (lab.json) nor a clean commit it ran "
            "from (run.json)"
        )
        lead = [
            f"{who}, so {dating}"
            + (f"the first run's start, {start}" if start else "the runs' starts")
            + left_out
        ]
    else:
        lead = [f"{hashed} of the {len(runs)} runs recorded the rules' sha256 as they started (lab.json)"]
        if committed:
            lead.append(f"{committed} the clean commit they ran from (run.json's code)")
        lead.append(
            f"{len(old)} neither, for which {dating}"
            + (f"the first of their starts, {start}" if start else "their starts")
            + left_out
        )
    history_only = bool(old) and not hashed and not committed
    return f"{what} {', '.join(lead)}: {_results(list(verdicts.values()), history_only)}"


def _agree(why: str, n: int) -> str:
    """A reason written with ``{has}``, ``{its}``, ``{differs}`` for ``n`` files."""
    one = n == 1
    for token, single, plural in (
        ("{has}", "has", "have"),
        ("{its}", "its", "their"),
        ("{differs}", "differs", "differ"),
    ):
        why = why.replace(token, single if one else plural)
    return why


def _results(verdicts: list[_Verdict], history_only: bool) -> str:
    fixed = [v for v in verdicts if v.state == "fixed"]
    parts = []
    if fixed:
        names = _short([v.file for v in fixed])
        dated = [v.history for v in fixed if v.history]
        latest = max(dated, key=lambda h: h[1]) if dated else None
        when = (
            f"{'the latest ' if len(dated) > 1 else ''}{latest[0][:7]}, {clock.shown(latest[1])}"
            if latest
            else ""
        )
        if history_only:
            text = f"{names} {'has its' if len(fixed) == 1 else 'have their'} current content since "
            text += f"{'a commit' if len(fixed) == 1 else 'commits'} authored before that start ({when})"
        else:
            text = f"{names} {'is' if len(fixed) == 1 else 'are'} as every run started with"
            if when:
                text += (
                    f" (for the runs that recorded neither, by commits authored before that start: {when})"
                )
        parts.append(text)
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for v in verdicts:
        if v.changed:
            groups.setdefault(("changed", tuple(v.changed)), []).append(v.file)
        if v.unknown:
            groups.setdefault(("unknown", tuple(v.unknown)), []).append(v.file)
        if v.notes:
            groups.setdefault(("note", tuple(v.notes)), []).append(v.file)
    for (kind, why), files in groups.items():
        if kind == "unknown":
            parts.append(f"for {_short(files)} it cannot be stated: {'; '.join(why)}")
        else:
            parts.append(
                f"{_short(files)}: {'; '.join(_agree(w, len(files)) for w in why)}"
                if kind == "note"
                else f"{_short(files)} {'; '.join(_agree(w, len(files)) for w in why)}"
            )
    if any(v.state == "changed" for v in verdicts):
        end = "So not every rule was fixed before the runs."
    elif any(v.state == "unknown" for v in verdicts):
        end = "So whether every rule was fixed before the runs cannot be stated."
    else:
        end = "So the rules were fixed before the runs."
    return "; ".join(parts) + f". {end}"
