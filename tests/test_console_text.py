"""Recorded text on the console: one way to print it (issue 56, bug 1 and item 2).

* Bug 1. Tried: run.json's recorded reason ``ValueError: row 17 of [/data/train.jsonl] has no prompt``, then
  ``tim train --resume``. Before: the resume note was printed as rich markup, so ``[/data/train.jsonl]`` raised
  ``MarkupError``; run.json then recorded that MarkupError as the new reason, and every later resume failed the same
  way with the checkpoint intact. A bracket that opens a tag made text vanish (``[enforce fail at ...]``, ``[b, s, h]
  vs [bold]``). Now: everything recorded reaches the console through
  :func:`tim_megatron.untrusted.recorded` (markup and control characters escaped, clipped); the reason prints
  as itself.
* Item 2. Every rich console call in the package is walked (below): an interpolated value that is not passed
  through ``recorded`` (or formatted as a number) fails the test, naming the file and line.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tim_megatron.untrusted import printable, recorded, terminal

PACKAGE = Path(__file__).resolve().parents[1] / "tim_megatron"
CONSOLES = {"console", "err", "say"}
"""Names the package gives a rich console (and ``<x>.console``)."""
SANITIZERS = {"recorded"}
NUMERIC_SPECS = tuple("dfeEgGx%")
"""A format spec ending in one of these takes only a number: no text can come through it."""


def _is_console(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in CONSOLES) or (
        isinstance(node, ast.Attribute) and node.attr == "console"
    )


def _safe(node: ast.expr) -> bool:
    """``node``, printed by rich, cannot carry recorded text unescaped."""
    if isinstance(node, ast.Constant):
        return True
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in SANITIZERS | {"len"}
    ):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace":
        return _safe(node.func.value) and all(_safe(a) for a in node.args)  # recorded(x).replace("\n", ...)
    if isinstance(node, ast.IfExp):
        return _safe(node.body) and _safe(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        return _safe(node.left) and _safe(node.right)
    if isinstance(node, ast.JoinedStr):
        return all(_safe(v) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        spec = node.format_spec
        if spec is not None and all(isinstance(v, ast.Constant) for v in spec.values):
            text = "".join(str(v.value) for v in spec.values)
            if text.endswith(NUMERIC_SPECS):
                return True
        return _safe(node.value)
    return False


def unescaped_console_text(source: str, name: str = "<source>") -> list[str]:
    """``"file:line"`` for every rich console call in ``source`` that passes a value other than a constant, a
    number's format or a :func:`recorded` result."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("print", "log") or not _is_console(node.func.value):
            continue
        if not all(_safe(a) for a in node.args):
            bad.append(f"{name}:{node.lineno}")
    return bad


def _console_calls(source: str) -> int:
    return sum(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("print", "log")
        and _is_console(n.func.value)
        for n in ast.walk(ast.parse(source))
    )


def test_no_console_call_prints_recorded_text_unescaped():
    bad, calls = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        calls += _console_calls(source)
        bad += unescaped_console_text(source, str(path.relative_to(PACKAGE.parent)))
    assert calls >= 30, calls  # the walk sees the package's console calls
    assert not bad, f"console calls that print a value without recorded(): {bad}"


def test_the_walk_finds_a_planted_unescaped_value():
    planted = [
        'console.print(f"resumes: {note}")',
        "tracker.console.print(text, highlight=False)",
        'err.print("error: " + msg)',
        "console.print(f\"{r['job']:>8}\")",  # a text format, not a number's
    ]
    for line in planted:
        assert unescaped_console_text(line), line
    fine = [
        'console.print(f"resumes: {recorded(note)}")',
        'console.print(f"{n:d} of {len(xs)} at {x:.3g}", highlight=False)',
        'console.print("      " + recorded(e, 10, lines=True).replace("\\n", "\\n  "))',
    ]
    for line in fine:
        assert not unescaped_console_text(line), line


def _printed(markup: str) -> str:
    out = io.StringIO()
    terminal(file=out, force_terminal=True, color_system=None).print(markup, highlight=False)
    return out.getvalue()


def test_the_reasons_of_bug_1_print_as_themselves():
    for text in (
        "ValueError: row 17 of [/data/train.jsonl] has no prompt",
        "[enforce fail at inline_container.cc:595] . unexpected pos 704 vs 598",
        "shape [b, s, h] vs [bold]",
        "a backslash \\ inside",
        "an emoji code :smile: stays text",
    ):
        assert _printed(recorded(text)) == text + "\n"
    # A trailing backslash is doubled by rich's escape (it would otherwise escape the tag that may follow it):
    # shown twice, never a MarkupError, never a tag of the line eaten.
    assert _printed(recorded("ends in \\") + "[bold]x[/]") == "ends in \\x\n"
    assert _printed(recorded("\x1b]0;title\x07 \u202e \x9b31m")) == "\\x1b]0;title\\x07 \\u202e \\x9b31m\n"
    assert _printed(recorded("x" * 1000, 10)) == "x" * 10 + "... (990 more characters)\n"


@settings(max_examples=150, deadline=None)
@given(
    reason=st.text(max_size=300),
    attempt=st.one_of(st.text(max_size=120), st.integers(), st.none(), st.lists(st.integers(), max_size=3)),
    step=st.one_of(st.integers(), st.text(max_size=20), st.none(), st.floats(allow_nan=True)),
)
def test_any_recorded_text_round_trips_through_a_resume_and_prints_as_itself(reason, attempt, step):
    """Whatever run.json's earlier attempt holds, the resume note prints (no MarkupError), shows the reason's first
    line as itself with control characters escaped, and puts no control character on the terminal."""
    from tim_megatron.run_dir import resume_note

    meta = {
        "attempt": "9.1",
        "earlier_attempts": [{"attempt": attempt, "status": "failed", "step": step, "reason": reason}],
    }
    note = resume_note(meta, start_step=5)
    shown = _printed(f"  {recorded(note, 1000)}")
    assert shown.endswith("\n") and printable(shown[:-1]) == shown[:-1]
    first = next(iter(reason.strip().splitlines()), "")
    if first and len(first) <= 200:
        assert f"failed ({printable(first)})" in shown
