"""Metrics sinks: ``metrics.jsonl`` (always), wandb (offline without an API key), and the console.

``metrics.jsonl`` is appended to without following a link, and a resumed run trims it only when it is a regular
file, rewritten by an atomic rename: a link planted there (a run folder from elsewhere) is refused by name,
neither read nor written through."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from tim_megatron import metric_names as names
from tim_megatron import safe_files
from tim_megatron.recipe.schema import Recipe
from tim_megatron.safe_files import open_append, write_atomic
from tim_megatron.untrusted import UnreadableFile, open_regular, printable, shown

SUMMARY_KEYS = (
    ("reward", names.REWARD, "{:.3f}"),
    ("rho_std", names.RHO_STD, "{:.2e}"),
    ("clip", names.CLIP_HIGH, "{:.3f}"),
    ("len", names.RESPONSE_LENGTH, "{:.1f}"),
    # Per token, next to the length: the per-sequence sum grows with length at a fixed per-token mismatch.
    ("log_ppl_diff/tok", names.LOG_PPL_TOKEN, "{:.2e}"),
    ("lr", names.LR, "{:.1e}"),
    ("step_s", names.STEP_SECONDS, "{:.2f}"),
)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


WANDB_PROBE_SECONDS = 5.0
"""How long to try reaching the wandb server before logging offline."""
WANDB_INIT_TIMEOUT = 60.0
"""wandb's own ``init_timeout`` (its default is 90 s) for a server that answers the probe but not init."""


def unreachable(url: str, *, timeout: float) -> str | None:
    """Why ``url``'s host (or the HTTPS proxy in the environment) cannot be connected to; None if it can.

    The connect runs in a daemon thread, so a slow name lookup cannot hold the caller past ``timeout``.
    """
    import socket
    import threading
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(url)
    host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(u.scheme or "https")
    if proxy and host and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname, p.port or 80
    if not host:
        return f"no host in {url!r}"
    result: list[str | None] = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port}: {e}")

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else f"{host}:{port}: no answer within {timeout:g} s"


def truncate_jsonl(path: Path, *, after_step: int) -> int:
    """Drop lines of steps > ``after_step`` (written after the checkpoint a resumed run restarts from), streaming
    the run's own file whatever its length. :class:`tim_megatron.safe_files.UnsafePathError` if ``path`` is a link
    or a special file."""
    if not os.path.lexists(path):
        return 0
    dropped = 0

    def kept(f):
        nonlocal dropped
        for raw in f:
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError):  # a line cut by a crash, a huge integer, deep nesting
                row = None
            step = row.get("step", 0) if isinstance(row, dict) else None
            if not isinstance(step, int) or step > after_step:
                dropped += 1
                continue
            yield raw if raw.endswith(b"\n") else raw + b"\n"

    with safe_files.open_regular(path, what="metrics file") as f:
        write_atomic(path, kept(f), what="metrics file")
    return dropped


class Tracker:
    def __init__(
        self, recipe: Recipe, *, run_dir: Path, name: str, run_id: str, enabled: bool = True, console=None
    ):
        self.recipe = recipe
        self.run_dir = run_dir
        self.enabled = enabled
        self.console = console
        self.jsonl = open_append(run_dir / "metrics.jsonl", what="metrics file") if enabled else None
        self.wandb = None
        if enabled:
            self.wandb = self._wandb(name, run_id)

    def _wandb(self, name: str, run_id: str):
        """A wandb run; online falls back to offline (with a warning) when the server cannot be reached.

        A quick connect to the server (or the HTTPS proxy) decides first, so no network costs seconds, not
        wandb's own 90 s init timeout; an init that fails anyway is retried offline. Offline runs upload
        later with ``wandb sync``. Nothing wandb does stops a run: metrics.jsonl has every step.
        """
        cfg = self.recipe.logging.wandb
        mode = cfg.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode == "disabled":
            return None
        import wandb

        tags = [*cfg.tags, self.recipe.rl.loss]
        if self.recipe.run.sweep_id:
            tags.append(f"sweep:{self.recipe.run.sweep_id}")
        kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=self.recipe.model_dump(mode="json"),
            tags=tags,
            group=self.recipe.run.sweep_id,
        )
        offline = f"logging offline into {self.run_dir / 'wandb'} (upload it later with `wandb sync`)"
        if mode == "online":
            url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
            problem = unreachable(url, timeout=WANDB_PROBE_SECONDS)
            if problem:
                self._warn(f"wandb server {url} cannot be reached ({problem}): {offline}")
                mode = "offline"
        settings = wandb.Settings(silent=True, init_timeout=WANDB_INIT_TIMEOUT)
        try:
            with _no_weave():
                return wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:
            if mode != "online":
                self._warn(f"wandb.init failed ({type(e).__name__}: {e}); metrics.jsonl keeps every step")
                return None
            self._warn(f"wandb.init online failed ({type(e).__name__}: {str(e)[:300]}): {offline}")
        try:
            wandb.teardown()  # forget the failed online run, whose id the offline one reuses
            with _no_weave():
                return wandb.init(mode="offline", settings=settings, **kwargs)
        except Exception as e:
            self._warn(
                f"wandb.init offline failed too ({type(e).__name__}: {e}); metrics.jsonl keeps every step"
            )
            return None

    @staticmethod
    def _warn(msg: str) -> None:
        import warnings

        warnings.warn(msg, stacklevel=3)

    def log(self, step: int, metrics: dict, *, events: list | None = None) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        if events:
            row["events"] = events
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=step)
            except (
                Exception
            ) as e:  # e.g. its service process got the job's SIGTERM too: metrics.jsonl goes on
                self._drop_wandb(e)

    def summary_line(self, step: int, total: int, metrics: dict) -> str:
        parts = [f"step {step}/{total}"]
        for label, key, fmt in SUMMARY_KEYS:
            v = metrics.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                parts.append(f"{label} {fmt.format(v)}")
        return "  ".join(parts)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:
                self._drop_wandb(e)
            self.wandb = None

    def _drop_wandb(self, err: Exception) -> None:
        import warnings

        warnings.warn(
            f"wandb stopped working ({type(err).__name__}: {err}); metrics.jsonl keeps every step",
            stacklevel=2,
        )
        self.wandb = None


@contextlib.contextmanager
def _no_weave():
    """Switch off wandb's Weave integration for ``wandb.init`` only.

    vLLM imports ``openai``, so wandb >= 0.19 prints "Detected [openai] in use" and a Weave advertisement at every
    init (``wandb/integration/weave/weave.py``, read at init time). ``WANDB_DISABLE_WEAVE`` is its documented
    off switch; it has no ``wandb.Settings`` field. A value the user set is left as it is.
    """
    if "WANDB_DISABLE_WEAVE" in os.environ:
        yield
        return
    os.environ["WANDB_DISABLE_WEAVE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("WANDB_DISABLE_WEAVE", None)


MAX_METRICS_BYTES = 512 << 20
"""A ``metrics.jsonl`` larger than this is not read (:class:`MetricsError`). A row of the project's metrics
is about 8 kB, so this holds some 60,000 steps; the rows read take about as much memory as the file."""
MAX_METRICS_LINE_BYTES = 1 << 20
"""A longer line is skipped as corrupt without being held in memory."""
MAX_STEP = 1 << 53
"""Largest ``step`` a row may carry: every step up to it is exact as a float (the report's x axis)."""
FLOAT_MAX = sys.float_info.max


class MetricsError(UnreadableFile):
    """A ``metrics.jsonl`` that is not read at all: not a regular file, unreadable, or over the size limit."""


def read_metrics(
    path: Path, problems: list[str] | None = None, *, max_bytes: int | None = None
) -> list[dict]:
    """Rows of a ``metrics.jsonl``, sorted by step; a step written twice (a resumed run) keeps its last row.

    The file may come from anyone, so it is streamed line by line and bounded: a corrupt line (a run killed
    mid-write, a row without an integer ``step`` in 0..MAX_STEP, nesting deeper than Python can parse, a line
    over :data:`MAX_METRICS_LINE_BYTES`) is skipped, and a value no float can hold (an integer of 400 digits)
    is left out of its row. When ``problems`` is given, a message naming the file and line number is appended
    to it for each. :class:`MetricsError` (a ``ValueError``) if the file is not a regular file, cannot be read,
    or holds more than ``max_bytes`` (default :data:`MAX_METRICS_BYTES`).
    """
    limit = MAX_METRICS_BYTES if max_bytes is None else max_bytes
    note = problems.append if problems is not None else (lambda _msg: None)
    shown_path = printable(str(path))
    names: dict[str, str] = {}  # one string per metric name, shared by all rows
    by_step: dict[int, dict] = {}
    try:
        f = open_regular(path)
    except UnreadableFile as e:
        raise MetricsError(str(e)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise MetricsError(_too_large(shown_path, f"{size} bytes", limit))
        total = 0
        try:
            for i, (length, line) in enumerate(_lines(f), start=1):
                total += length
                if total > limit:  # the file grew while it was read
                    raise MetricsError(_too_large(shown_path, f"more than {limit} bytes", limit))
                if line is None:
                    note(
                        f"{shown_path}:{i}: skipped a line of {length} bytes (at most {MAX_METRICS_LINE_BYTES})"
                    )
                    continue
                row = _parse_row(line, f"{shown_path}:{i}", note)
                if row is not None:
                    by_step[row["step"]] = {names.setdefault(k, k): v for k, v in row.items()}
        except OSError as e:
            raise MetricsError(f"{shown_path}: cannot be read ({e.strerror or e})") from None
    return [by_step[k] for k in sorted(by_step)]


def _too_large(where: str, size: str, limit: int) -> str:
    return (
        f"{where}: {size}; a metrics.jsonl of at most {limit} bytes is read (MAX_METRICS_BYTES in "
        "tim_megatron/logging/tracker.py); keep a shorter copy of the run's metrics to report on it"
    )


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(bytes consumed, line) for each line; a line over the limit is read in pieces and comes as None."""
    while True:
        line = f.readline(MAX_METRICS_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_METRICS_LINE_BYTES or line.endswith(b"\n"):
            yield len(line), line
            continue
        length = len(line)
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_METRICS_LINE_BYTES)
            length += len(line)
        yield length, None


def _parse_row(line: bytes, where: str, note: Callable[[str], None]) -> dict | None:
    """The row on one line, without values no float can hold; None (with a note) if the line is corrupt."""
    text = line.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit integer; deep nesting
        note(f"{where}: skipped a corrupt line ({printable(str(e))[:200]})")
        return None
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        what = "no 'step'" if step is None else f"step = {shown(step)}"
        note(f"{where}: skipped a corrupt line ({what}; a row needs an integer step in 0..{MAX_STEP})")
        return None
    for key in [k for k, v in row.items() if not _fits_float(v)]:
        del row[key]
        note(f"{where}: left out {shown(key)}: its value holds an integer too large for a float")
    return row


def _fits_float(value: object) -> bool:
    """Whether every integer in ``value`` (nested lists and objects too) converts to a float."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and not -FLOAT_MAX <= v <= FLOAT_MAX:
            return False
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return True
