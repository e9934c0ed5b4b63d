"""An ``argparse.ArgumentParser`` whose usage errors suggest the flag or subcommand the user probably meant.

argparse answers a misspelled flag with ``unrecognized arguments: --max-token-per-gpu 10`` (or, when the
misspelled flag was a required one, ``the following arguments are required: ...``) and a misspelled subcommand
with the list of every choice. :class:`SuggestingArgumentParser` keeps those messages and appends
``-- did you mean --max-tokens-per-gpu?`` for every unknown ``--flag`` of the command line that is close to a flag
of the (sub)command being parsed (a flag that names a layout dimension in other words, ``--tensor-parallel-size``,
suggests the layout flag it means, ``--tp``: :func:`~megatron_dynbatch.core.parallel.layout_key_meaning`), and for
an invalid choice close to a valid one. Choice flags take :func:`choice` as their type -- the one rule for
choices: matched case-insensitively (``--recompute FULL``), a miss naming the close match (``ful`` -> ``full``),
in this CLI and in a Megatron launch alike. Instead of argparse's usage dump it prints that one line and where the
flags are listed (``megatron-dynbatch plan --help``). Used by the ``megatron-dynbatch`` CLI and the demo; exit
status 2, on stderr, as before.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, List, NoReturn, Optional, Sequence

from .core.checks import close_matches
from .core.parallel import layout_key_meaning
from .core.planner.option_flags import choice

__all__ = ["SuggestingArgumentParser", "help_hint", "suggestions", "choice"]


def _subparsers(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps sub-parsers here and nowhere public
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def _known_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """Option strings of ``parser``, or of the sub-command named in ``argv`` when ``parser`` has sub-commands."""
    subs = _subparsers(parser)
    for token in argv:
        if token in subs:
            return _known_flags(subs[token], argv[list(argv).index(token) + 1:])
    return [s for s in parser._option_string_actions if s.startswith("--")]  # noqa: SLF001


def suggestions(parser: argparse.ArgumentParser, argv: Sequence[str], message: str) -> List[str]:
    """What the user probably meant, for ``message`` (an argparse error) about the command line ``argv``: a valid
    choice (``'bench'``) or flags (``--max-tokens-per-gpu for --max-token-per-gpu``)."""
    hints: List[str] = []
    if "did you mean" in message:  # said already (a choice flag's own type: :func:`choice`)
        return hints
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        options = [o.strip().strip("'\"") for o in choice.group(2).split(",")]  # quoted before Python 3.12.8
        close = close_matches(choice.group(1), options, n=1, cutoff=0.6)
        if close:
            hints.append(f"'{close[0]}'")
        return hints
    known = _known_flags(parser, argv)
    for token in argv:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag in known or any(k.startswith(flag) for k in known):
            continue  # a known flag, or an unambiguous abbreviation argparse accepts
        meant = [f"--{m.replace('_', '-')}" for m in layout_key_meaning(flag[2:], outside=True)]
        close = [m for m in meant if m in known][:1] or close_matches(flag, known, n=1, cutoff=0.75)
        if close:
            hints.append(f"{close[0]} for {flag}")
    return hints


class SuggestingArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` with "did you mean" hints on usage errors (sub-parsers inherit the class)."""

    _argv: Sequence[str] = ()

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None):  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """The one line that matters (what is wrong, and the likely flag meant), then where the full list of flags
        is -- not argparse's usage dump, which buried that line under up to 17 lines of every flag."""
        hints = suggestions(self, self._argv, message)
        text = f"{self.prog}: error: {message}"
        if len(hints) == 1:
            text += f" -- did you mean {hints[0].split(' for ')[0]}?"
        elif hints:
            text += f" -- did you mean {', '.join(hints)}?"
        self.exit(2, f"{text}\n({help_hint(self, self._argv)})\n")


def help_hint(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """Where the help of the (sub)command ``argv`` runs is: ``megatron-dynbatch plan --help lists its flags``, or
    for the top level ``megatron-dynbatch --help lists the commands``."""
    subs = _subparsers(parser)
    for token in argv:
        if token in subs:
            return help_hint(subs[token], argv[list(argv).index(token) + 1:])
    return f"{parser.prog} --help lists " + ("the commands" if subs else "its flags")
