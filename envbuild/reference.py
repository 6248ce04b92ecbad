"""The references generated from what they describe: docs/cli.md from the click commands,
docs/manifest.md from the manifest's schema (envbuild/plan/schema.py), docs/components.md from
the plan's components (their order and docstrings), and docs/schemas/ (a JSON schema of each
matrix file, from its pydantic model: an editor validates a lab's matrix as it is typed). For the CLI: every
command, argument and option is declared once (envbuild/cli/), and this module renders what the
declarations say (usage, help, value type or choices, default, environment variable). The output
depends on nothing but the declarations, so a test can compare it with the committed file.

    python -m envbuild.reference docs/cli.md          # write it
    python -m envbuild.reference docs/cli.md --check  # exit 1 if it is stale
    python -m envbuild.reference docs/manifest.md     # the manifest's keys and labels
    python -m envbuild.reference docs/components.md   # the components of a stack image
    python -m envbuild.reference docs/schemas         # the matrix files' JSON schemas
"""

from __future__ import annotations

import argparse
import json
import inspect
import re
import sys
from pathlib import Path

import click

from envbuild import cli
from envbuild.knowledge.matrix.loader import MODELS
from envbuild.plan import schema
from envbuild.plan.stack import COMPONENTS, RUNTIME_ORDER

COMMAND = "python -m envbuild.reference docs/cli.md"



def _usage(ctx: click.Context, command: click.Command) -> str:
    """The usage line, composed here: click's own wording of it moves between releases (8.5
    writes a group that runs without a subcommand as `[COMMAND]`, 8.4 as `COMMAND`).

    >>> group = click.Group("g", invoke_without_command=True)
    >>> _usage(click.Context(group, info_name="g"), group)
    'g [OPTIONS] [COMMAND] [ARGS]...'
    """
    pieces = [ctx.command_path, command.options_metavar or "[OPTIONS]"]
    for param in command.params:
        if isinstance(param, click.Argument):
            pieces += param.get_usage_pieces(ctx)
    if isinstance(command, click.Group):
        pieces.append("[COMMAND] [ARGS]..." if command.invoke_without_command else "COMMAND [ARGS]...")
    return " ".join(pieces)

def commands(group: click.Group, ctx: click.Context | None = None):
    """(context, command) for the group and every command under it, depth first, in name order;
    hidden commands included (the reference marks them)."""
    ctx = ctx or click.Context(group, info_name="envbuild")
    yield ctx, group
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        sub = click.Context(command, info_name=name, parent=ctx)
        if isinstance(command, click.Group):
            yield from commands(command, sub)
        else:
            yield sub, command


def is_help_option(param: click.Parameter, ctx: click.Context) -> bool:
    return set(param.opts) <= set(ctx.help_option_names) and getattr(param, "is_flag", False)


def paragraphs(text: str | None) -> list[str]:
    """A docstring as Markdown paragraphs: click's rules (`\\f` ends the help, a `\\b` paragraph
    keeps its line breaks), other paragraphs joined into one line each."""
    text = inspect.cleandoc(text or "").split("\f", 1)[0]
    out = []
    for para in re.split(r"\n\s*\n", text):
        if not para.strip():
            continue
        if para.startswith("\b\n"):  # Markdown's hard line break: two spaces at the end of a line
            out.append("  \n".join(markdown_text(line.rstrip()) for line in para.splitlines()[1:]))
        else:
            out.append(markdown_text(" ".join(para.split())))
    return out


def one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def markdown_text(text: str) -> str:
    r"""Help text as Markdown that shows what `--help` shows: outside `code spans`, the characters
    Markdown would read as HTML, emphasis or a table cell's end are escaped.

    >>> print(markdown_text("Build directory (default ./build/<tag>); `a <b>` stays; DS_BUILD_*"))
    Build directory (default ./build/\<tag>); `a <b>` stays; DS_BUILD_\*
    """
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if i % 2 else re.sub(r"([\\<*|])", r"\\\1", part) for i, part in enumerate(parts))


def _metavar(param: click.Parameter, ctx: click.Context) -> str:
    try:
        return param.make_metavar(ctx)
    except TypeError:  # click < 8.2: make_metavar() takes no context
        return param.make_metavar()


def _default(param: click.Parameter, ctx: click.Context) -> str | None:
    """The default as the user would type it; None where there is none to show (unset, a flag
    that is off, an empty list)."""
    value = param.get_default(ctx, call=False)
    if isinstance(value, bool) or callable(value):
        return None
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, (list, tuple)) and value:
        return ", ".join(str(v) for v in value)
    return None


def describe(param: click.Parameter, ctx: click.Context) -> str:
    """One list item: the option's spellings and value, then what the declaration says of it."""
    names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    facts = []
    if isinstance(param, click.Option) and param.is_flag:
        facts.append("flag")
    else:
        names = "`" + ", ".join([*param.opts, *param.secondary_opts]) + " " + _metavar(param, ctx) + "`"
        if isinstance(param.type, click.Choice):
            facts.append("one of " + ", ".join(f"`{c}`" for c in param.type.choices))
    if param.required:
        facts.append("required")
    if getattr(param, "multiple", False):
        facts.append("repeatable")
    default = _default(param, ctx)
    if default is not None:
        facts.append(f"default: `{default}`")
    envvar = getattr(param, "envvar", None)
    if envvar:
        facts.append("env: " + ", ".join(f"`{e}`" for e in ([envvar] if isinstance(envvar, str) else envvar)))
    line = f"- {names}" + (f" ({'; '.join(facts)})" if facts else "")
    help_text = markdown_text(one_line(getattr(param, "help", None)))
    return line + (f": {help_text}" if help_text else "")


def render(group: click.Group) -> str:
    """The Markdown reference of `group` and every command under it."""
    lines = [
        "# Command-line reference",
        "",
        "Generated from the command declarations in `envbuild/cli/` by",
        f"`{COMMAND}`; do not edit it by hand: a test fails when",
        "this file differs from what that command writes. Every command also takes `-h`/`--help`.",
        "Options that several commands share are declared once and listed under each command that",
        "takes them.",
        "",
    ]
    entries = list(commands(group))
    lines += ["| command | what it does |", "|---|---|"]
    for ctx, command in entries[1:]:
        hidden = " (hidden from `--help`)" if command.hidden else ""
        short = markdown_text(one_line(command.get_short_help_str(limit=10_000)))
        lines.append(f"| [`{ctx.command_path}`](#{anchor(ctx.command_path)}) | {short}{hidden} |")
    lines.append("")
    for ctx, command in entries:
        lines += [f"## {ctx.command_path}", ""]
        usage = _usage(ctx, command)
        lines += ["```", usage, "```", ""]
        if command.hidden:
            lines += ["Hidden from `envbuild --help`: a maintenance command.", ""]
        for para in paragraphs(command.help):
            lines += [para, ""]
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        options = [p for p in command.params if not isinstance(p, click.Argument) and not is_help_option(p, ctx)
                   and not getattr(p, "hidden", False)]
        if arguments:
            lines += ["Arguments:", ""]
            lines += [f"- `{_metavar(p, ctx)}`" + (" (required)" if p.required else "")
                      + (" (repeatable)" if p.nargs == -1 else "") for p in arguments]
            lines.append("")
        if options:
            lines += ["Options:", ""]
            lines += [describe(p, ctx) for p in options]
            lines.append("")
        if isinstance(command, click.Group) and ctx.parent is not None:
            subs = command.list_commands(ctx)
            if subs:
                lines += ["Commands: " + ", ".join(f"[`{ctx.command_path} {n}`](#{anchor(ctx.command_path + ' ' + n)})"
                                                   for n in subs), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as '-'.

    >>> anchor("envbuild matrix refresh")
    'envbuild-matrix-refresh'
    >>> anchor("Many nodes: the fabric")
    'many-nodes-the-fabric'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def reference() -> str:
    """docs/cli.md as the installed CLI declares it."""
    return render(cli.main)


def components() -> str:
    """docs/components.md: each component of a stack image in build order, with its docstring."""
    lines = ["# The components of a stack image", "",
             "<!-- Generated by `python -m envbuild.reference docs/components.md` from envbuild/plan/components/. -->",
             "", "A stack image's plan is folded from these modules, in this order (the builder's steps follow it, "
             "the slowest-changing first); each is a module with `part(ctx) -> Part` "
             "(`envbuild/plan/components/base.py`: the `Component` protocol). "
             "The runtime stage copies from the builder in a second order: "
             + ", ".join(f"`{c.__name__.rsplit('.', 1)[-1]}`" for c in RUNTIME_ORDER)
             + ". [architecture.md](architecture.md) shows where the plan sits.", ""]
    for n, component in enumerate(COMPONENTS, 1):
        name = component.__name__.rsplit(".", 1)[-1]
        lines += [f"## {n}. `{name}`", "", f"`{component.__name__.replace('.', '/')}.py`", "",
                  *(p for para in paragraphs(component.__doc__) for p in (para, ""))]
    return "\n".join(lines).rstrip("\n") + "\n"


def matrix_schemas() -> dict[str, str]:
    """docs/schemas/: `<file>.schema.json` for each matrix file, from the model that reads it."""
    out = {}
    for name, model in sorted(MODELS.items()):
        doc = {"$schema": "https://json-schema.org/draft/2020-12/schema",
               "$comment": f"Generated by `python -m envbuild.reference docs/schemas` from the model of matrices/{name}.",
               **model.model_json_schema()}
        out[name.replace(".yaml", ".schema.json")] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return out


def _generated(path: Path) -> dict[Path, str]:
    """Each file the path names, with the text it should hold."""
    if path.name == "schemas":
        return {path / name: text for name, text in matrix_schemas().items()}
    return {path: {"manifest.md": schema.reference, "components.md": components}.get(path.name, reference)()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envbuild.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="what to write: docs/cli.md, docs/manifest.md, docs/components.md "
                                                "or the folder docs/schemas")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = {p: text for p, text in _generated(args.path).items()
             if (p.read_text(encoding="utf-8") if p.is_file() else None) != text}
    if stale and args.check:
        print(f"{', '.join(map(str, stale))} stale: it differs from what it is generated from; run "
              f"`python -m envbuild.reference {args.path}`.", file=sys.stderr)
        return 1
    for p, text in stale.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
