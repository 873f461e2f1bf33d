"""Test helpers that read the documentation: its markdown files, their links, and the shell commands in their code
blocks and inline code (split into `ditserve ...` and `grpcurl ...` invocations)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from servicekit import REPO_ROOT

SHELL_FENCES = ("bash", "sh", "shell", "console")
"""Fence languages read as shell (diagrams and trees are unlabeled or `text`)."""
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE = re.compile(r"`([^`\n]+)`")
_PUNCT = "();<>|&\n"


def doc_files() -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def prose(markdown: str) -> str:
    """The markdown without its fenced code blocks (links in code are not links)."""
    return _FENCE.sub("", markdown)


def links(markdown: str) -> list[str]:
    """Every link and image target in the prose and tables."""
    return _LINK.findall(prose(markdown))


def shell_blocks(markdown: str) -> list[str]:
    """The text of every shell code block."""
    return [body for lang, body in _FENCE.findall(markdown) if lang in SHELL_FENCES]


def inline_code(markdown: str) -> list[str]:
    """Every inline code span outside fenced blocks."""
    return _INLINE.findall(prose(markdown))


def commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a shell snippet, as argv lists: quotes resolved, comments dropped, split at newlines
    (unless continued with a backslash), pipes, `;`, `&&`, redirections and groups."""
    lex = shlex.shlex(_uncommented(script.replace("\\\n", " ")), posix=True, punctuation_chars=_PUNCT)
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    lex.commenters = ""  # done above: shlex's own would swallow the newline that ends the command
    argv: list[str] = []
    try:
        for token in lex:
            if token and all(c in _PUNCT for c in token):
                if argv:
                    yield argv
                argv = []
            else:
                argv.append(token)
    except ValueError:  # an unbalanced quote (a placeholder in prose): what came before still counts
        pass
    if argv:
        yield argv


def _uncommented(script: str) -> str:
    """`script` less its comments: a `#` starting a word outside quotes, to the end of its line (an apostrophe in a
    comment is no quote)."""
    out: list[str] = []
    quote, i = "", 0
    while i < len(script):
        c = script[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or script[i - 1] in " \t\n;|&("):
            end = script.find("\n", i)
            i = len(script) if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class Invocation:
    """One `ditserve SUBCOMMAND ...` in the docs."""

    where: str
    subcommand: str
    args: list[str]

    def flags(self) -> list[str]:
        """The `--flag` tokens (`--flag=value` as `--flag`; `[--flag` of a synopsis as `--flag`)."""
        out = []
        for a in self.args:
            a = a.strip("[]")
            if a.startswith("--") and len(a) > 2:
                out.append(a.split("=", 1)[0].split("/", 1)[0])
        return out


def _is_ditserve(token: str) -> bool:
    return token.rsplit("/", 1)[-1] == "ditserve"


def ditserve_invocations(path: Path) -> Iterator[Invocation]:
    """Every `ditserve ...` command in `path`'s shell blocks and inline code (`python -m ditserve ...` too)."""
    text = path.read_text()
    snippets = [*shell_blocks(text), *(s for s in inline_code(text) if re.match(r"(\S*/)?ditserve ", s))]
    for snippet in snippets:
        for argv in commands(snippet):
            at = next((i for i, token in enumerate(argv[:-1]) if _is_ditserve(token)), None)
            if at is not None and re.fullmatch(r"[a-z][a-z-]*", argv[at + 1]):  # not a placeholder (COMMAND)
                yield Invocation(rel(path), argv[at + 1], argv[at + 2 :])


@dataclass(frozen=True)
class GrpcurlCall:
    where: str
    args: list[str]

    def method(self) -> str | None:
        """`pkg.Service/Method` or `describe`'s symbol, when the call names one."""
        for a in self.args:
            if re.fullmatch(r"[a-z_][\w.]*\.[A-Z]\w*(/[A-Z]\w*)?", a):
                return a
        return None

    def data(self) -> str | None:
        """The `-d` argument (None when absent)."""
        for i, a in enumerate(self.args[:-1]):
            if a == "-d":
                return self.args[i + 1]
        return None


def grpcurl_calls(path: Path) -> Iterator[GrpcurlCall]:
    """Every grpcurl call in `path`'s shell blocks and inline code (`$G` where a block defines `G=...grpcurl`)."""
    text = path.read_text()
    for snippet in [*shell_blocks(text), *(s for s in inline_code(text) if "grpcurl " in s)]:
        alias = re.search(r'^(\w+)="?\S*grpcurl\b', snippet, re.M)
        names = {"grpcurl"} | ({f"${alias.group(1)}"} if alias else set())
        for argv in commands(snippet):
            for i, token in enumerate(argv):
                if token.rsplit("/", 1)[-1] in names:
                    yield GrpcurlCall(rel(path), argv[i + 1 :])
                    break
