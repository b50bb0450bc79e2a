"""Write iggy-edge(1) in roff from the CLI's own help (build.sh runs it).

    python packaging/deb/manpage.py VERSION > iggy-edge.1

Every command and group, its help text and its options, walked from the
click tree typer builds: the page cannot drift from `iggy-edge --help`.
Not help2man: it would see only the top level (one --help screen), and
rich's box drawing in that screen is no roff.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import typer
from iggy_edge.cli.main import app
from typer import Context


def esc(text: str) -> str:
    """roff-safe text: backslashes, hyphens, and lines that would be requests."""
    text = text.replace("\\[", "[")  # rich markup's escape, not meant for the reader
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + x if x.startswith((".", "'")) else x for x in text.splitlines())


def paragraphs(text: str) -> str:
    """Blank-line-separated paragraphs as .PP; click's \\b (keep as is) as .nf."""
    out: list[str] = []
    for para in text.strip().split("\n\n"):
        if para.startswith("\b\n"):
            out += [".PP", ".nf", esc(para[2:]), ".fi"]
        else:
            out += [".PP", esc(" ".join(x.strip() for x in para.splitlines()))]
    return "\n".join(out)


def walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, cmd
    if hasattr(cmd, "list_commands"):  # a group (typer vendors click: no isinstance)
        for name in sorted(cmd.list_commands(Context(cmd))):
            sub = cmd.get_command(Context(cmd), name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, [*path, name])


def option_lines(cmd: Any, ctx: Context) -> list[str]:
    out: list[str] = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or param.name == "help":  # every command has --help: said once
            continue
        names, help_text = record
        out += [".TP", "\\fB" + esc(names) + "\\fR", esc(" ".join(help_text.split())) or "\\&"]
    return out


def usage(cmd: Any, ctx: Context) -> str:
    return " ".join(cmd.collect_usage_pieces(ctx))


def render(version: str) -> str:
    root = typer.main.get_command(app)
    date = time.strftime("%Y-%m-%d", time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))))
    lines = [
        '.TH IGGY\\-EDGE 1 "%s" "iggy\\-edge %s" "User Commands"' % (date, esc(version)),
        ".SH NAME",
        "iggy\\-edge \\- " + esc(root.help.splitlines()[0] if root.help else "edge gateway agent"),
        ".SH SYNOPSIS",
        "\\fBiggy\\-edge\\fR [\\fB\\-\\-version\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION",
        paragraphs(app.info.help or ""),
        ".PP",
        "Every command takes \\fB\\-\\-help\\fR, which prints its section below.",
        ".SH OPTIONS",
        *option_lines(root, Context(root, info_name="iggy-edge")),
        ".SH COMMANDS",
    ]
    for path, cmd in walk(root, []):
        if not path:
            continue
        parent = Context(root, info_name="iggy-edge")
        ctx = Context(cmd, info_name=" ".join(["iggy-edge", *path]), parent=parent)
        lines += [".SS " + esc(" ".join(["iggy-edge", *path])) + " " + esc(usage(cmd, ctx))]
        lines.append(paragraphs(cmd.help or cmd.short_help or ""))
        lines += option_lines(cmd, ctx)
    lines += [
        ".SH FILES",
        ".TP",
        "\\fI/etc/iggy\\-edge/config.toml\\fR",
        "The configuration (\\fBiggy\\-edge config example\\fR prints every key).",
        ".TP",
        "\\fI/etc/iggy\\-edge/env\\fR",
        "Secrets for the service (mode 0600).",
        ".TP",
        "\\fI/var/lib/iggy\\-edge\\fR",
        "The durable buffer and the agent's state.",
        ".SH SEE ALSO",
        "\\fI/usr/share/doc/iggy\\-edge/README.md\\fR,"
        " \\fI/usr/share/doc/iggy\\-edge/operations.md\\fR,"
        " \\fBsystemctl\\fR(1), \\fBmosquitto\\fR(8)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(sys.argv[1] if len(sys.argv) > 1 else "unknown"))
