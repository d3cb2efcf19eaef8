"""The error every data problem raises: a run's inputs are unusable, named in the message."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset, or one of its rows, cannot be used. The message names the recipe key, the file and line (or
    the dataset and row index), what is wrong and what is allowed; the CLI shows it without a traceback."""


def listing(head: str, problems: list[str], *, shown: int = 5) -> str:
    """``head`` and the first ``shown`` problems, then how many more there are: the user fixes them in one go
    instead of meeting them one run at a time."""
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{head}: " + "; ".join(problems[:shown]) + more
