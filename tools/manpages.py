"""Write the man pages and the bash completions of `alkfs` and `alkfsd` from their argparse
parsers (alkfs/cli/parser.py's `build_parser`, daemon/config.py's `parser`):

    man/alkfs.1  man/alkfsd.8  completion/alkfs.bash  completion/alkfsd.bash

    .venv/bin/python tools/manpages.py            # (re)write them in the checkout
    .venv/bin/python tools/manpages.py --out DIR  # write them under DIR instead
    .venv/bin/python tools/manpages.py --check    # exit 1 if a committed one is stale

The files are committed (make install copies them; tests/test_manpages.py fails when one
is stale), so change a parser, then run this. A man page has every command (nested ones
too) with its options, positionals, help text and example (the `example:` paragraph of
its epilog); a paragraph that several commands' epilogs share is written once, under
NOTES. A completion offers the commands, each command's options and the choices of an
option that has them; anything else falls back to file names.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from alkfs import __version__
from alkfs.cli import build_parser
from alkfsd.config import parser as daemon_parser

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Page:
    prog: str
    section: int
    parser: argparse.ArgumentParser
    source: str  # where the parser is built
    environment: dict[str, str] = field(default_factory=dict)
    see_also: list[str] = field(default_factory=list)


PAGES = [
    Page(
        "alkfs",
        1,
        build_parser(),
        "alkfs/cli/parser.py",
        {
            "ALKFS_MOUNT": "the mount to work through when neither --mount nor --store is given",
            "ALKFS_STORE": "the store to work on when neither --mount nor --store is given",
            "ALKFS_DATABASE": "with a store: its PostgreSQL database, when --database is not given",
            "ALKFS_DEBUG": "if set, the library's log and the traceback of an unexpected error",
        },
        ["alkfsd(8)"],
    ),
    Page(
        "alkfsd",
        8,
        daemon_parser(),
        "daemon/config.py",
        {
            "ALKFS_DATABASE": "the store's PostgreSQL database, when --database is not given",
            "NOTIFY_SOCKET": "where READY=1 is sent once the mount answers (systemd, Type=notify)",
            "JOURNAL_STREAM": "when it names stderr (under systemd), log lines carry syslog "
            "priority prefixes (<3> error, <4> warning, <6> info, <7> debug) and no timestamp",
            "ALKFS_LOG_PRIORITIES": "1: the same lines as for the journal (the mount helper "
            "sets it for its logger --prio-prefix)",
        },
        ["alkfs(1)", "mount(8)", "systemd.service(5)"],
    ),
]


# -- the parsers --------------------------------------------------------------------------


@dataclass
class Command:
    path: tuple[str, ...]  # () for the program itself; ("roots", "add")
    parser: argparse.ArgumentParser
    help: str


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help: str = ""
) -> Iterator[Command]:
    """The parser and its subcommands', depth first, in the order they were added."""
    yield Command(path, parser, help or parser.description or "")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name), helps[name])


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings]


def own_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in options(parser) for s in a.option_strings}


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [
        name
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction)
        for name in a.choices
    ]


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """Its help, and its default when it has one the help does not mention."""
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if takes_value(action) and action.default not in (None, argparse.SUPPRESS):
        if "default" not in text:
            text = f"{text} (default {action.default})" if text else f"Default {action.default}."
    return text


def epilog_parts(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(its example lines, its other paragraphs) of a parser's epilog."""
    examples: list[str] = []
    notes: list[str] = []
    for para in (parser.epilog or "").split("\n\n"):
        head, _, rest = para.strip().partition(":")
        if head.lower() in ("example", "examples"):
            examples += [line.strip() for line in rest.splitlines() if line.strip()]
        elif para.strip():
            notes.append(para.strip())
    return examples, notes


# -- roff ---------------------------------------------------------------------------------


def esc(text: str) -> str:
    """Text for a roff line: backslashes and minus signs escaped, a leading . or ' made safe."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in out.split("\n"))


def bold(text: str) -> str:
    return f"\\fB{esc(text)}\\fR"


def italic(text: str) -> str:
    return f"\\fI{esc(text)}\\fR"


def usage_item(action: argparse.Action) -> str:
    if isinstance(action, argparse._SubParsersAction):
        word = italic(metavar(action)) + " ..."
        return word if action.required else f"[{word}]"
    if action.option_strings:
        opt = action.option_strings[-1]  # (the long one)
        word = bold(opt) + (" " + italic(metavar(action)) if takes_value(action) else "")
        return word if action.required else f"[{word}]"
    word = italic(metavar(action))
    if action.nargs in ("+", "*"):
        word += " ..."
    return f"[{word}]" if action.nargs in ("?", "*") else word


def term(action: argparse.Action) -> str:
    if not action.option_strings:
        return usage_item(action).strip("[]")
    value = " " + italic(metavar(action)) if takes_value(action) else ""
    return ", ".join(bold(o) + value for o in action.option_strings)


def items(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    """A tagged paragraph for each action (a positional without help has none: the
    synopsis names it)."""
    out = []
    for a in actions:
        text = help_text(parser, a) or ("Required." if a.required and a.option_strings else "")
        if text or a.option_strings:
            out += [".TP", term(a), *([esc(text)] if text else [])]
    return out


def synopsis(prog: str, actions: list[argparse.Action]) -> list[str]:
    shown = [a for a in actions if not isinstance(a, argparse._HelpAction)]
    words = [usage_item(a) for a in shown if a.option_strings]
    words += [usage_item(a) for a in shown if not a.option_strings]
    return [f".B {esc(prog)}", *words]


def example(lines: list[str]) -> list[str]:
    return [".PP", "Example:", ".PP", ".RS 4", ".nf", *map(esc, lines), ".fi", ".RE"]


def man_page(page: Page) -> str:
    p = page.parser
    cmds = list(commands(p))
    common = own_options(p)  # (described once, under OPTIONS)
    seen: dict[str, int] = {}
    for c in cmds:
        for note in epilog_parts(c.parser)[1]:
            seen[note] = seen.get(note, 0) + 1
    shared = [n for n, count in seen.items() if count > 1]
    name = (p.description or page.prog).rstrip(".")
    out = [
        f'.\\" Generated by tools/manpages.py from {page.source}: do not edit.',
        f'.TH {page.prog.upper()} {page.section} "" "{page.prog} {__version__}" "alkfs"',
        ".SH NAME",
        f"{page.prog} \\- {esc(name[:1].lower() + name[1:])}",
        ".SH SYNOPSIS",
        *synopsis(page.prog, p._actions),
        ".SH DESCRIPTION",
        esc(p.description or ""),
    ]
    top_examples, top_notes = epilog_parts(p)
    out += [".PP", *map(esc, (n for n in top_notes if n not in shared))] if top_notes else []
    if positionals(p) and not subcommands(p):
        out += [".SH ARGUMENTS", *items(p, positionals(p))]
    out += [".SH OPTIONS", *items(p, options(p))]
    if len(cmds) > 1:
        out += [".SH COMMANDS"]
        leaves = [c for c in cmds[1:] if not subcommands(c.parser)]
        everywhere = [
            a
            for a in options(p)
            if all(set(a.option_strings) <= own_options(c.parser) for c in leaves)
        ]
        if everywhere:
            names = ", ".join(bold(s) for a in everywhere for s in a.option_strings)
            out += [f"Every command also takes {names}."]
    for c in cmds[1:]:
        own = [
            a
            for a in c.parser._actions
            if not isinstance(a, argparse._HelpAction)
            and not (set(a.option_strings) & common)
            and not isinstance(a, argparse._SubParsersAction)
        ]
        subs: list[argparse.Action] = [
            a for a in c.parser._actions if isinstance(a, argparse._SubParsersAction)
        ]
        prog = " ".join((page.prog, *c.path))
        out += [f'.SS "{esc(" ".join(c.path))}"', *synopsis(prog, own + subs), ".PP", esc(c.help)]
        if subs:
            subnames = [bold(" ".join((*c.path, s))) for s in subcommands(c.parser)]
            out += [".PP", f"Its commands: {', '.join(subnames)}."]
        if own:
            out += items(c.parser, [a for a in own if not a.option_strings])
            out += items(c.parser, [a for a in own if a.option_strings])
        examples, notes = epilog_parts(c.parser)
        for note in notes:
            if note not in shared:
                out += [".PP", esc(note)]
        if examples:
            out += example(examples)
    if top_examples:
        out += [".SH EXAMPLE", ".RS 4", ".nf", *map(esc, top_examples), ".fi", ".RE"]
    if shared:
        out += [".SH NOTES"]
        for note in shared:
            out += [".PP", esc(note)]
    if page.environment:
        out += [".SH ENVIRONMENT"]
        for var, text in page.environment.items():
            out += [".TP", bold(var), esc(text)]
    if page.see_also:
        refs = [f"\\fB{esc(r.split('(')[0])}\\fR({r.split('(')[1]}" for r in page.see_also]
        out += [".SH SEE ALSO", ",\n".join(refs)]
    return "\n".join(out) + "\n"


# -- bash completion ----------------------------------------------------------------------

COMPLETION = r"""# bash completion for {prog}: generated by tools/manpages.py from {source} (do not edit)
declare -gA _{fn}_commands=({commands})
declare -gA _{fn}_options=({options})
declare -gA _{fn}_takes_value=({takes_value})
declare -gA _{fn}_choices=({choices})

# the command path ("{prog} roots add") from the words before the cursor, then the
# subcommands, options or an option's choices that fit; else file names (-o default)
_{fn}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    local path={prog} i w skip=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${{COMP_WORDS[i]}}
        if [[ $w == = ]]; then
            continue
        elif ((skip)); then
            skip=0
        elif [[ $w == -* ]]; then
            [[ $w != *=* && " ${{_{fn}_takes_value[$path]-}} " == *" $w "* ]] && skip=1
        elif [[ " ${{_{fn}_commands[$path]-}} " == *" $w "* ]]; then
            path="$path $w"
        fi
    done
    COMPREPLY=()
    if ((skip)); then
        [[ $prev == = ]] && prev=${{COMP_WORDS[COMP_CWORD-2]}}
        COMPREPLY=($(compgen -W "${{_{fn}_choices["$path $prev"]-}}" -- "$cur"))
    elif [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "${{_{fn}_options[$path]-}}" -- "$cur"))
    elif [[ -n ${{_{fn}_commands[$path]-}} ]]; then
        COMPREPLY=($(compgen -W "${{_{fn}_commands[$path]-}}" -- "$cur"))
    fi
    return 0
}}
complete -o default -F _{fn} {prog}
"""


def table(entries: dict[str, str]) -> str:
    if not entries:
        return ""
    rows = [f'    ["{key}"]="{value}"' for key, value in entries.items()]
    return "\n" + "\n".join(rows) + "\n"


def completion(page: Page) -> str:
    cmds, opts, values, choices = {}, {}, {}, {}
    for c in commands(page.parser):
        path = " ".join((page.prog, *c.path))
        if subcommands(c.parser):
            cmds[path] = " ".join(subcommands(c.parser))
        opts[path] = " ".join(s for a in options(c.parser) for s in a.option_strings)
        valued = [a for a in options(c.parser) if takes_value(a)]
        if valued:
            values[path] = " ".join(s for a in valued for s in a.option_strings)
        for a in valued:
            if a.choices is not None:
                for s in a.option_strings:
                    choices[f"{path} {s}"] = " ".join(map(str, a.choices))
    for text in (*cmds, *cmds.values(), *opts.values(), *values.values(), *choices.values()):
        assert not set(text) & set('"\\$`'), text  # (the tables are written unquoted)
    return COMPLETION.format(
        prog=page.prog,
        fn=page.prog.replace("-", "_"),
        source=page.source,
        commands=table(cmds),
        options=table(opts),
        takes_value=table(values),
        choices=table(choices),
    )


# -- main ---------------------------------------------------------------------------------


def outputs() -> dict[str, str]:
    """relative path -> content of every generated file."""
    out = {}
    for page in PAGES:
        out[f"man/{page.prog}.{page.section}"] = man_page(page)
        out[f"completion/{page.prog}.bash"] = completion(page)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=ROOT, help="write under OUT (default: the checkout)"
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if one is stale")
    a = ap.parse_args(argv)
    stale = []
    for rel, text in outputs().items():
        path = a.out / rel
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale (run tools/manpages.py): {' '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
