"""Every command's --help renders what its source says: rich markup does not
eat `[[routes]]`, and the short help in a group's list is the whole first
paragraph (a hard newline would cut it there)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from iggy_edge.cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()
WIDE = {"COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}


def commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def help_of(path: tuple[str, ...]) -> str:
    result = runner.invoke(app, [*path, "--help"], env=WIDE)
    assert result.exit_code == 0, (path, result.output)
    return " ".join(result.output.split())


def plain(text: str) -> str:
    """The source text as it should read: rich's escapes resolved, whitespace normalised."""
    return " ".join(text.replace("\\[", "[").split())


ALL = list(commands(typer.main.get_command(app)))


def test_every_command_has_help_that_renders_its_brackets() -> None:
    assert len(ALL) > 30
    lost = []
    for path, command in ALL:
        shown = help_of(path)
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        for text in texts:
            lost += [(path, b) for b in re.findall(r"\\?\[\[?[a-z_.]+\]\]?", text) if plain(b) not in shown]
    assert lost == []


def test_short_help_in_a_group_is_the_whole_first_paragraph() -> None:
    cut = []
    for path, command in ALL:
        subs = getattr(command, "commands", {})
        if not subs:
            continue
        shown = help_of(path)
        for name, sub in subs.items():
            first = plain((sub.short_help or sub.help or "").split("\n\n")[0])
            if first not in shown:
                cut.append((" ".join(path), name))
    assert cut == []


def test_arguments_in_usage_lines_are_named_as_the_help_text_names_them() -> None:
    """typer marks a required argument {NAME}; the name is the one the
    command's text uses (FILE, DEVICE_ID), not the Python parameter's."""
    lowercase = []
    for path, _command in ALL:
        usage = re.search(
            r"Usage: \S+(?: \S+)*? \[OPTIONS\]((?: [{\[][A-Za-z_]+[}\]](?:\.\.\.)?)*)", help_of(path)
        )
        assert usage, path
        lowercase += [(path, m) for m in re.findall(r"[{\[]([a-z_]+)[}\]]", usage[1])]
    assert lowercase == []
