"""Every shell command in README.md runs, as written, somewhere in CI, or says why not (issue 22, "The README is
executable"): tests/helpers/readme.py's `WHERE` table holds one row per command of README's ```bash blocks, and the
runner each row names holds the command verbatim. Fast: reads files, runs nothing."""

from __future__ import annotations

import re

import pytest

from tests.helpers.readme import ROOT, WHERE, readme_commands, shell_lines

RUNNERS = {"ci": ROOT / ".ci" / "run", "wheel-smoke": ROOT / "scripts" / "wheel_smoke.sh"}
TABLE = "tests/helpers/readme.py (WHERE)"


def _runs_verbatim(command: str, script_lines: list[str]) -> bool:
    """A logical line of the script is the command, or ends with it after a space (`step NAME COMMAND`)."""
    return any(line == command or line.endswith(" " + command) for line in script_lines)


def test_every_readme_command_has_exactly_one_row():
    commands, rows = readme_commands(), set(WHERE)
    missing = [c for c in commands if c not in rows]
    stale = sorted(rows - set(commands))
    message = [f"README command without a row in {TABLE}; add one (where it runs, or 'not run: REASON'):\n  {c!r}"
               for c in missing]  # fmt: skip
    message += [f"row in {TABLE} for a command README no longer has; delete or update it:\n  {c!r}" for c in stale]
    assert not message, "\n".join(message)


def test_every_row_names_a_runner_or_a_reason():
    known = (*RUNNERS, "pytest:")
    bad = [
        f"{c!r}: {w!r}"
        for c, w in WHERE.items()
        if not w.startswith(known) and not re.fullmatch(r"not run: \S.{10,}", w)
    ]
    assert not bad, "where must be 'ci', 'wheel-smoke', 'pytest:PATH::TEST' or 'not run: REASON':\n" + "\n".join(bad)


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_runner_runs_its_commands_verbatim(runner):
    path = RUNNERS[runner]
    lines = shell_lines(path.read_text(encoding="utf-8"))
    absent = [c for c, w in WHERE.items() if w == runner and not _runs_verbatim(c, lines)]
    assert not absent, f"{path.relative_to(ROOT)} does not run these README commands as written (add a line that " + (
        f"ends with the exact text, or change the row in {TABLE}):\n" + "\n".join(f"  {c}" for c in absent)
    )


def test_pytest_rows_name_a_test_that_holds_the_command():
    bad = []
    for command, where in WHERE.items():
        if not where.startswith("pytest:"):
            continue
        path, _, test = where.removeprefix("pytest:").partition("::")
        file = ROOT / path
        text = file.read_text(encoding="utf-8") if file.is_file() else ""
        if command not in text or not re.search(rf"^\s*def {re.escape(test)}\(", text, flags=re.M):
            bad.append(f"{where}: needs def {test}( and the exact text {command!r}")
    assert not bad, "\n".join(bad)


def test_the_parser_joins_continuations_strips_comments_and_skips_output_blocks(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "```bash\n"
        "cmd --a 1 \\\n"
        "   --b '# kept'   # dropped\n"
        "   # a comment line\n"
        "\n"
        "other  x=1#y\n"
        "```\n"
        "```\n"
        "output only\n"
        "```\n"
        "```python\n"
        "print('no')\n"
        "```\n"
        "```bash\n"
        "other  x=1#y\n"
        "```\n"
    )
    assert readme_commands(readme) == ["cmd --a 1 --b '# kept'", "other x=1#y"]
