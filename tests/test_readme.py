"""The README's examples run as written.

Conventions (stated in the README too, in a comment above its first example):

- every line starting with `$ ` in a ```console block is a command, run by bash in a fresh directory, with `chatapp`
  standing for this checkout's CLI (`python -m chatapp`, the script's own entry point, with the repository on
  PYTHONPATH);
- the lines under a command, up to the next command or the block's end, are output it must print (stdout or
  stderr), each line somewhere in the output; `...` in a line matches anything;
- a command's comment `# exit code N` says the exit code it must end with (0 otherwise); a comment `# not run:
  REASON` skips it, with that reason (the TUI, a file the reader must bring);
- a block whose info string has `file=NAME` (```toml file=brief.toml) is written to NAME in that directory first.

The commands run on the default model, prepared once into the CHATAPP_HOME the SmolLM2 tests share
(`tests/conftest.py`, `default_model_home`), as a user's first command would prepare it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FENCE = re.compile(r"^```(?P<info>.*)$")
EXIT_CODE = re.compile(r"#\s*exit code (?P<code>\d+)\s*$")
NOT_RUN = re.compile(r"#\s*not run: (?P<reason>.+)$")
# Bounds one example: the slowest (training the tiny model, a batch on the default model) take seconds.
TIMEOUT_S = 300


@dataclass(frozen=True)
class Example:
    line: int  # in README.md, 1-based
    command: str
    shown: tuple[str, ...]  # the output lines under it

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def read_readme(text: str) -> tuple[list[Example], dict[str, str]]:
    """The console examples and the `file=NAME` blocks of a README."""
    examples: list[Example] = []
    files: dict[str, str] = {}
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        info = opening["info"].split()
        start = index + 1
        index = start
        while index < len(lines) and not lines[index].startswith("```"):
            index += 1
        body = lines[start:index]
        index += 1
        names = [word.removeprefix("file=") for word in info[1:] if word.startswith("file=")]
        if names:
            files[names[0]] = "\n".join(body) + "\n"
        if info[:1] == ["console"]:
            examples.extend(_commands(body, start + 1))
    return examples, files


def _commands(body: list[str], first_line: int) -> list[Example]:
    found: list[Example] = []
    for offset, line in enumerate(body):
        if line.startswith("$ "):
            found.append(Example(first_line + offset, line[2:], ()))
        elif found and line.strip():
            last = found[-1]
            found[-1] = Example(last.line, last.command, (*last.shown, line))
    return found


def shown_pattern(line: str) -> re.Pattern[str]:
    """A shown output line as a pattern over one line of the output: `...` matches anything."""
    return re.compile(".*".join(re.escape(part.strip()) for part in line.split("...")))


EXAMPLES, FILES = read_readme(README.read_text(encoding="utf-8"))


def test_the_readme_has_examples_of_every_command() -> None:
    """Each command of the CLI appears in a console example (so this test covers the README's whole tour)."""
    commands = {name for example in EXAMPLES for name in re.findall(r"\bchatapp (\w+)", example.command)}
    expected = {"info", "models", "run", "generate", "calc", "program", "batch", "lens", "train", "eval", "route"}
    assert expected <= commands, f"no README example of {sorted(expected - commands)}"
    assert {"brief.toml", "questions.jsonl", "chat.jsonl"} <= set(FILES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.id for example in EXAMPLES])
def test_readme_example(example: Example, default_model_home: Path, tmp_path: Path) -> None:
    if (skip := NOT_RUN.search(example.command)) is not None:
        pytest.skip(f"{example.id}: not run: {skip['reason']}")
    for name, content in FILES.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CHATAPP_DEFAULT_MODEL"}
    env.update(CHATAPP_HOME=str(default_model_home), PYTHONPATH=str(REPO), COLUMNS="120", TERM="dumb")
    script = f'chatapp() {{ {shlex.quote(sys.executable)} -m chatapp "$@"; }}\n{example.command}\n'
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = done.stdout + done.stderr
    code = EXIT_CODE.search(example.command)
    assert done.returncode == (int(code["code"]) if code else 0), f"{example.id}: {example.command}\n{output}"
    lines = output.splitlines()
    for shown in example.shown:
        pattern = shown_pattern(shown)
        assert any(pattern.search(line) for line in lines), f"{example.id}: no line like {shown!r} in\n{output}"


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercased, punctuation dropped (not `-` or `_`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda page: page.name)
def test_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    for match in LINK.finditer(page.read_text(encoding="utf-8")):
        target = match["target"]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(resolved), f"{page.name}: link to {target}: no such heading"
