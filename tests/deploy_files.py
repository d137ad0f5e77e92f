"""The deploy files as tests read them, and the ``profd`` commands that files show.

A command is ``profd`` followed by a subcommand and its options, found in shell code (YAML
string values, the Dockerfile's RUN steps), in markdown code (fenced blocks and inline spans),
and in comments and docstrings where it is quoted or set off as code; prose that merely
mentions profd is not a command.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


_PROFD = re.compile(r"(?<![\w./@$=:-])profd[ \t]+(\S.*)$")
_STOP = {";", "&&", "||", "|", ">", "2>&1", ")", "&"}


def cli_spec() -> dict[str | None, set[str]]:
    """Options per subcommand of the real typer app (``None``: the bare ``profd``)."""
    import click
    import typer

    from profd.cli.main import app

    group = typer.main.get_command(app)
    spec: dict[str | None, set[str]] = {None: {"--help"}}
    for name, cmd in group.commands.items():
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        help_opt = cmd.get_help_option(click.Context(cmd))
        spec[name] = opts | set(help_opt.opts if help_opt else ())
    return spec


def commands_in_line(line: str) -> list[list[str]]:
    """Every ``profd ...`` command in one line of shell or docs, as tokens after ``profd``."""
    found = []
    for m in _PROFD.finditer(line):
        text = re.sub(r"<[^>]*>", "X", m.group(1))  # <session-id | dir> is one placeholder
        tokens = []
        for tok in text.split():
            if tok in _STOP or tok.startswith(("#", ">", "`")):
                break
            tokens.append(tok.strip("[]`\"'"))
        found.append([t for t in tokens if t])
        found.extend(commands_in_line(text))
    return found


def command_errors(tokens: list[str], spec: dict[str | None, set[str]]) -> list[str]:
    sub = None if not tokens or tokens[0].startswith("-") else tokens[0]
    if sub not in spec:
        return [f"no subcommand {sub!r}"]
    return [
        f"{sub or 'profd'} has no option {t.split('=')[0]}"
        for t in tokens
        if t.startswith("-") and not re.fullmatch(r"-\d.*", t) and t.split("=")[0] not in spec[sub]
    ]


def _yaml_lines(path: Path) -> list[str]:
    """String values (shell scripts, entrypoints) and comment lines that start with a command."""
    lines: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            lines.extend(_shell_lines(node.splitlines()))

    for doc in load_all(path):
        walk(doc)
    for raw in path.read_text().splitlines():
        if "#" in raw:
            lines.extend(_comment_commands(raw.split("#", 1)[1]))
    return lines


def _shell_lines(lines: list[str]) -> list[str]:
    """Shell code as it is; of a comment, only the commands it quotes."""
    out = []
    for line in lines:
        m = re.search(r"(?:^|\s)#", line)
        out.append(line[: m.start()] if m else line)
        if m:
            out.extend(_comment_commands(line[m.end() :]))
    return out


def _comment_commands(text: str) -> list[str]:
    """In a comment or docstring line: `quoted` commands, and a command set off as code
    (indented by two or more spaces, or after ``$ ``); prose that mentions profd is not one."""
    spans = re.findall(r"`([^`]+)`", text)
    if re.match(r"\s{2,}(\$ )?profd ", text) or text.lstrip().startswith("$ profd "):
        spans.append(text.strip().removeprefix("$ "))
    return spans


def markdown_lines(text: str) -> list[str]:
    """Fenced code as shell lines; of prose, the inline code spans, paragraph by paragraph, so
    a span broken over two lines (as markdown allows) is read whole."""
    lines: list[str] = []
    fenced = False
    paragraph: list[str] = []

    def flush() -> None:
        lines.extend(s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", "\n".join(paragraph)))
        paragraph.clear()

    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            flush()
            fenced = not fenced
        elif fenced:
            lines.extend(_shell_lines([raw]))
        elif raw.strip():
            paragraph.append(raw)
        else:
            flush()
    flush()
    return lines


#: The markdown files whose commands are checked: the README, deploy/, docs/ and examples/.
MARKDOWN = sorted(
    [
        ROOT / "README.md",
        *DEPLOY.rglob("*.md"),
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "examples").glob("*.md"),
    ]
)


def markdown_commands(path: Path) -> list[list[str]]:
    """Every profd command one markdown file shows (fenced blocks and inline code)."""
    return [tok for line in markdown_lines(path.read_text()) for tok in commands_in_line(line)]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file, tokens) for every profd command in deploy/, docs/, examples/ and the README."""
    sources: list[tuple[Path, list[str]]] = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *(ROOT / "examples").glob("*.yaml")]):
        sources.append((path, _yaml_lines(path)))
    for path in MARKDOWN:
        sources.append((path, markdown_lines(path.read_text())))
    docker = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    docker += [t for ln in DOCKERFILE.read_text().splitlines() for t in _shell_lines([ln])[1:]]
    sources.append((DOCKERFILE, docker))
    for path in sorted((ROOT / "examples").glob("*.py")):
        lines = path.read_text().splitlines()
        sources.append((path, [t for raw in lines for t in _comment_commands(raw)]))
    return [
        (str(path.relative_to(ROOT)), tokens)
        for path, lines in sources
        for line in lines
        for tokens in commands_in_line(line)
    ]
