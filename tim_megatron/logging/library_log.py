"""The libraries' own output during a run goes to a file in the run folder, not to the console.

Before the first step vLLM, megatron-core and torch print about 40 lines: vLLM's build and performance advice,
a cast of each fp32 checkpoint tensor into the bf16 engine, megatron-core's "Apex is not installed"
``UserWarning`` s, torch deprecations, a C++ NUMA notice. None of them is about the run, and a new user reads them
as failures. While a run lasts (:func:`routed`, around ``loop.train``):

* vLLM's log (logger ``vllm`` and its children, at ``logging.engine_level``) is written to
  ``<run_dir>/logs/engine.log``. Its records at ERROR or above also reach the console (stderr). vLLM is then told
  not to configure its own logging (:func:`tim_megatron.rollout.engine_log.engine_logging_config`), which would
  put back its console handler when the engine starts; a ``VLLM_LOGGING_CONFIG_PATH`` of the user's still wins.
* Records of other libraries' loggers that reach the root logger go to the same file (ERROR and above to the
  console too). Python prints them on stderr otherwise, for want of a handler. The project itself prints
  through its console, not through ``logging``.
* Python warnings raised from library code go to the file as well. Warnings raised from the project's code
  (``tim_megatron/``, ``patches/``) or of a category it defines (e.g.
  :class:`tim_megatron.integrity.IntegrityWarning`) are shown as before, on stderr, by the hook that was in place.
* torch's C++ warnings are written by C++ straight to stderr: :func:`quiet_torch_cpp_log` sets
  ``TORCH_CPP_LOG_LEVEL=ERROR`` before torch loads, unless the user set it (``TORCH_CPP_LOG_LEVEL=WARNING`` shows
  them again; they are not in the file).

The console names the file when the run starts and, at its end, says how many warnings the file received.
Each rank writes its own file: ``engine.log`` for rank 0, ``engine.rank<N>.log`` for rank N; only rank 0
prints the two lines. Everything is put back when the run ends.

The file is appended to without following a link, in a ``logs/`` folder that must be a real folder inside the
run folder: a run folder from elsewhere cannot have the libraries' output appended to another file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from tim_megatron.safe_files import check_inside, open_append
from tim_megatron.untrusted import open_regular, recorded

ENGINE_LOGGER = "vllm"
"""The logger vLLM logs through (its modules log to children of it)."""
PROJECT_CODE = (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "patches")
"""The project's code (``tim_megatron/``, ``patches/``): warnings raised there stay on the console."""
PROJECT_PACKAGES = ("tim_megatron", "patches")
"""Warning categories defined in these packages stay on the console wherever they are raised."""
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s:%(lineno)d %(message)s"
"""A record in the file: when, level, where (vLLM's logger, i.e. its module; a warning's file) and line, message."""
CONSOLE_FORMAT = "%(levelname)s %(name)s:%(lineno)d %(message)s"
"""An engine error on the console."""


def log_file(run_dir: Path, rank: int) -> Path:
    """This rank's file: ``logs/engine.log`` for rank 0, ``logs/engine.rank<N>.log`` for the others;
    :class:`tim_megatron.safe_files.UnsafePathError` if ``logs`` is a link."""
    name = "engine.log" if rank == 0 else f"engine.rank{rank}.log"
    return check_inside(run_dir, Path(run_dir) / "logs" / name, what="engine log")


def is_project_warning(category: type[Warning], filename: str) -> bool:
    """A warning the console shows: of a category the project defines, or raised from the project's code."""
    if category.__module__.split(".")[0] in PROJECT_PACKAGES:
        return True
    try:
        where = Path(filename).resolve()
    except (OSError, ValueError):  # "<string>" and the like resolve; a NUL byte or a loop does not
        return False
    return any(where.is_relative_to(root) for root in PROJECT_CODE)


def quiet_torch_cpp_log(environ: MutableMapping[str, str] | None = None) -> None:
    """Show only errors of torch's C++ log (in ``environ``, default this process's environment, which the ranks
    inherit), unless ``TORCH_CPP_LOG_LEVEL`` is set already. Call it before torch is imported: libc10 reads the
    variable once, when it loads."""
    (os.environ if environ is None else environ).setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class EngineLogFile(logging.FileHandler):
    """The run's library log (appended to: a resumed run adds to it), counting the warnings it receives."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(logging.Formatter(FILE_FORMAT))
        self.warnings = 0
        """Records at WARNING (not ERROR or above) this handler wrote since the run started."""
        self.start = self.stream.tell()
        """Where the file ended when the run started (what was written since counts)."""

    def _open(self):
        """The file, appended to; a link or special file there is refused, not followed."""
        f = open_append(self.baseFilename, what="engine log")
        f.reconfigure(encoding=self.encoding, errors=self.errors)
        return f

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if record.levelno == logging.WARNING:
            self.warnings += 1


WARNING_RECORD = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING ", re.MULTILINE)
"""A record at WARNING in the file (:data:`FILE_FORMAT`: the time, then the level)."""
COUNTED_BYTES = 64 * 2**20
"""The most of a run's log read to count its warnings."""


def warnings_since(path: Path, start: int) -> int:
    """WARNING records in ``path`` after byte ``start`` (at most :data:`COUNTED_BYTES` of it read)."""
    try:
        with open_regular(path) as f:
            f.seek(start)
            return len(WARNING_RECORD.findall(f.read(COUNTED_BYTES)))
    except (OSError, ValueError):
        return 0


class ConsoleErrors(logging.Handler):
    """Library records at ERROR or above, on the ``sys.stderr`` of the moment they are logged."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.setFormatter(logging.Formatter(CONSOLE_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class LibraryLog:
    """The routing of one run; :meth:`close` puts back the handlers, levels and warning hook it replaced."""

    def __init__(self, path: Path, *, level: str):
        self.path = path
        self.file = EngineLogFile(path)
        self.console = ConsoleErrors()
        engine = logging.getLogger(ENGINE_LOGGER)
        self._engine_before = (list(engine.handlers), engine.level, engine.propagate)
        engine.handlers[:] = [self.file, self.console]
        engine.setLevel(level.upper())
        engine.propagate = False  # as vLLM's own configuration: its records stop at its handlers
        root = logging.getLogger()
        root.addHandler(self.file)
        root.addHandler(self.console)
        self._show_before = warnings.showwarning
        warnings.showwarning = self.show_warning

    @property
    def warning_count(self) -> int:
        """Warnings the file received during the run: those this process wrote, or, when more processes append to
        it (an engine in a process of its own), the WARNING records written to it since the run started."""
        return max(self.file.warnings, warnings_since(Path(self.path), self.file.start))

    def show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """``warnings.showwarning`` while the run lasts: library warnings to the file, the project's shown as
        before (an explicit ``file`` too)."""
        if file is not None or is_project_warning(category, filename):
            self._show_before(message, category, filename, lineno, file, line)
            return
        # named by its file, as vLLM's records by their module: "<file>:<line> <Category>: <message>"
        record = logging.LogRecord(
            filename, logging.WARNING, filename, lineno, "%s: %s", (category.__name__, message), None
        )
        self.file.handle(record)

    def close(self) -> None:
        if warnings.showwarning == self.show_warning:  # a hook installed after ours stays
            warnings.showwarning = self._show_before
        root = logging.getLogger()
        root.removeHandler(self.file)
        root.removeHandler(self.console)
        engine = logging.getLogger(ENGINE_LOGGER)
        handlers, level, propagate = self._engine_before
        if self.file in engine.handlers:  # else the user's VLLM_LOGGING_CONFIG_PATH replaced them: keep that
            engine.handlers[:] = handlers
            engine.setLevel(level)
            engine.propagate = propagate
        self.file.close()


def engine_log_target() -> tuple[str, str] | None:
    """(path, level) of the engine log this process routes vLLM's log to, or None: an engine in a process of its
    own (:mod:`tim_megatron.rollout.process_engine`) routes its own output to the same file."""
    engine = logging.getLogger(ENGINE_LOGGER)
    for h in engine.handlers:
        if isinstance(h, EngineLogFile):
            return h.baseFilename, logging.getLevelName(engine.level)
    return None


def routes_engine_log() -> bool:
    """Whether this process is routing vLLM's log now (then vLLM must leave its logger's handlers alone)."""
    return any(isinstance(h, EngineLogFile) for h in logging.getLogger(ENGINE_LOGGER).handlers)


@contextlib.contextmanager
def routed(run_dir: Path, *, level: str, console=None, rank: int | None = None) -> Iterator[LibraryLog]:
    """Route the libraries' output to this rank's file while the block runs; rank 0 names the file on
    ``console`` (a rich console) first and, if the file received warnings, counts them last.
    ``rank``: from the launcher's environment when not given."""
    if rank is None:
        from tim_megatron.dist_env import dist_env_from_environ

        rank = dist_env_from_environ(os.environ).rank
    log = LibraryLog(log_file(run_dir, rank), level=level)
    say = console if rank == 0 else None
    if say is not None:
        say.print(f"engine log: {recorded(log.path)}", highlight=False, soft_wrap=True)
    try:
        yield log
    finally:
        log.close()
        if say is not None and log.warning_count:
            n = log.warning_count
            say.print(
                f"engine log: {n:d} warning{'s' if n != 1 else ''} in {recorded(log.path)}",
                highlight=False,
                soft_wrap=True,
            )
