"""Command-line flags built from :class:`~.options.PlanOptions`' own fields: one source for every door's flags.

Strategy
--------
Megatron-Core builds argparse from a config dataclass (``ArgumentGroupFactory`` in NVIDIA/Megatron-LM
``megatron/training/argument_utils.py``: flag name, type and help from each field's annotation and docstring,
field metadata overriding). This module does the same for the planner's options, at each door that types them:

* the **name** is the field's spelling at that door -- ``metadata["megatron"]`` (a Megatron launch) or
  ``metadata["cli"]`` (``megatron-dynbatch plan``); a field without a ``--`` spelling there has no flag there;
* the **kind** of value comes from the annotation (``bool`` -> a switch, ``int``, ``float``, an ``Enum`` ->
  its values as choices, anything else -> text), or from ``metadata["kind"]`` where the annotation says too
  little (``budget``: a number of tokens or ``auto``; ``fraction``; ``int_or_text``); ``metadata["choices"]``
  makes a text field a choice;
* the **help** is the field's ``#:`` docstring in ``options.py`` (read once from the source, Sphinx roles and
  literals turned into plain text), so the docstring stays the one description.

Each door keeps only what is its own: how strictly text becomes a value (the ``plan`` command refuses ``--dp 0``
and ``--max-tokens-per-gpu -5`` at parse time, a launch leaves that to
:func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args`) and
defaults (a launch's are the fields' defaults; the ``plan`` command's are ``None`` = "not given", so a run preset
can decide, and its switches take ``--no-...``). Whether a value is valid is :class:`PlanOptions`' to say.

Choices, one rule everywhere: matched case-insensitively (``--recompute FULL`` = ``full``), and a miss names the
close match (``ful`` -> ``did you mean 'full'?``): :func:`choice`.

Invariant (``tests/test_option_flags.py``): every field with a ``--`` spelling at a door has exactly one flag at
that door, with its help text, and appears under that name in the flag tables of ``docs/integration.md`` and
``docs/quickstart.md``. Pure standard library (argparse); no torch.
"""

from __future__ import annotations

import argparse
import ast
import enum
import functools
import inspect
import re
import textwrap
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..checks import close_matches
from ..errors import in_other_words

__all__ = ["DOORS", "OptionFlag", "option_flags", "add_option_flags", "option_values", "field_docs", "choice",
           "positive_int", "tokens_or_auto", "plain_text"]

#: the doors whose users type options as flags (``metadata`` keys of a ``PlanOptions`` field)
DOORS = ("megatron", "cli")
AUTO = "auto"


# ============================================================================================ converters
def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1) (0.03 = 3%), got {text!r}")
    return value


def tokens_or_auto(text: str) -> Any:
    """A number of tokens or ``auto`` (any case); the number as typed (a launch checks it at start-up)."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of tokens nor 'auto'") from None


def _positive_budget(text: str) -> Any:
    """A whole number >= 1 or ``auto`` (any case)."""
    return AUTO if str(text).strip().lower() == AUTO else positive_int(text)


def _int_or_text(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def choice(choices: Iterable[str], *, strict: bool = True) -> Callable[[str], str]:
    """argparse type for a choice, the one rule for every choice flag: matched case-insensitively (the choice's
    own spelling comes back), and a miss says ``invalid choice: 'ful' (choose from 'none', 'selective', 'full')
    -- did you mean 'full'?``. ``strict=False``: a miss comes back as typed, for a flag whose value an options
    object checks (and names the close match) itself -- e.g. the memory settings' flags."""
    canon = {str(c).lower(): str(c) for c in choices}

    def parse(text: str) -> str:
        key = str(text).strip().lower()
        if key in canon:
            return canon[key]
        if not strict:
            return text
        close = close_matches(key, list(canon), n=1, cutoff=0.5)
        hint = f" -- did you mean {canon[close[0]]!r}?" if close else ""
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                         f"{', '.join(repr(c) for c in canon.values())}){hint}")

    parse.__name__ = "choice"  # argparse names the type in some messages
    return parse


#: how text becomes a value, per door and kind (module docstring: strictness is the door's own)
_CONVERTERS: Dict[str, Dict[str, Callable[[str], Any]]] = {
    "megatron": {"int": int, "float": float, "fraction": float, "budget": tokens_or_auto, "text": str,
                 "int_or_text": str},
    "cli": {"int": positive_int, "float": float, "fraction": _fraction, "budget": _positive_budget, "text": str,
            "int_or_text": _int_or_text},
}
_METAVARS = {"int": "N", "float": "X", "fraction": "X", "budget": "N|auto"}


# ============================================================================================ docstrings
_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def plain_text(text: str) -> str:
    """A docstring as plain one-line text for ``--help``: ``:class:`~a.b.C``` -> ``C``, ````x```` -> ``x``."""
    def role(m: "re.Match[str]") -> str:
        target = m.group(1)
        return target.rsplit(".", 1)[-1] if m.group(0).find("~") >= 0 else target

    text = _ROLE.sub(role, text).replace("``", "")
    return " ".join(text.split())


@functools.lru_cache(maxsize=None)
def field_docs(cls: Optional[type] = None) -> Dict[str, str]:
    """``field -> its #: docstring`` (plain text) of a dataclass, read once from its source: the ``#:`` comment
    lines right above each annotated field (the convention Sphinx reads). Empty when the source is not shipped."""
    if cls is None:
        from .options import PlanOptions

        cls = PlanOptions
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # pragma: no cover - a build without sources
        return {}
    lines = source.splitlines()
    out: Dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc: List[str] = []
        at = node.lineno - 2  # the line above the field (lineno is 1-based)
        while at >= 0 and lines[at].strip().startswith("#:"):
            doc.insert(0, lines[at].strip()[2:].strip())
            at -= 1
        if doc:
            out[node.target.id] = plain_text(" ".join(doc))
    return out


# ============================================================================================ the flags
@dataclass(frozen=True)
class OptionFlag:
    """One option's flag at one door."""

    field: str
    flag: str
    door: str
    kind: str                       # switch, choice, int, float, fraction, budget, int_or_text, text
    choices: Optional[Tuple[str, ...]]
    metavar: Optional[str]
    help: str
    default: Any

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under (its flag's name, as argparse derives it)."""
        return self.flag.lstrip("-").replace("-", "_")

    def argparse_kwargs(self) -> Dict[str, Any]:
        """The ``add_argument`` keywords of this flag at its door."""
        kw: Dict[str, Any] = {"help": self.help}
        if self.kind == "switch":
            if self.door == "cli":  # --no-... too: overrides a run preset's value
                off = "--no-" + self.flag[2:]
                return {**kw, "help": f"{self.help} ({off}: off, also over a --run preset's value)",
                        "action": argparse.BooleanOptionalAction, "default": None}
            if self.default is None:  # three states (unset: the option decides): --no-... is a value too
                return {**kw, "action": argparse.BooleanOptionalAction, "default": None}
            return {**kw, "action": "store_true", "default": bool(self.default)}
        kw["default"] = self.default if self.door == "megatron" else None
        if self.kind == "choice":
            assert self.choices is not None
            return {**kw, "type": choice(self.choices), "metavar": self.metavar or "{" + ",".join(self.choices) + "}"}
        kw["type"] = _CONVERTERS[self.door][self.kind]
        metavar = self.metavar or _METAVARS.get(self.kind)
        return {**kw, **({"metavar": metavar} if metavar else {})}


def _kind(annotation: Any, meta: Dict[str, Any]) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """The kind of value (and the choices) of a field: metadata first, else its annotation (module docstring)."""
    if meta.get("choices"):
        return "choice", tuple(str(c) for c in meta["choices"])
    if meta.get("kind"):
        return str(meta["kind"]), None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return "switch", None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "choice", tuple(str(m.value) for m in annotation)
    if annotation is int:
        return "int", None
    if annotation is float:
        return "float", None
    return "text", None


@functools.lru_cache(maxsize=None)
def option_flags(door: str) -> Tuple[OptionFlag, ...]:
    """Every option's flag at ``door`` (``"megatron"`` or ``"cli"``), in field order."""
    from .options import PlanOptions

    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, got {door!r}")
    hints = typing.get_type_hints(PlanOptions)
    docs = field_docs(PlanOptions)
    words = PlanOptions.spellings(door)  # the help speaks the door's words: --max-tokens-per-gpu, not the keyword
    out = []
    for f in fields(PlanOptions):
        flag = str(f.metadata.get(door) or "")
        if not (f.init and flag.startswith("--")):
            continue
        kind, choices = _kind(hints[f.name], dict(f.metadata))
        default = None if f.default is MISSING else f.default
        out.append(OptionFlag(f.name, flag, door, kind, choices, f.metadata.get("metavar"),
                              in_other_words(docs.get(f.name, ""), words), default))
    return tuple(out)


def add_option_flags(parser: Any, door: str, *, only: Optional[Iterable[str]] = None,
                     skip: Iterable[str] = ()) -> List[OptionFlag]:
    """Add the options' flags of ``door`` to ``parser`` (a parser or an argument group): all of them, or the
    fields named in ``only``, minus ``skip``. Returns the flags added."""
    wanted = None if only is None else set(only)
    added = []
    for spec in option_flags(door):
        if (wanted is not None and spec.field not in wanted) or spec.field in set(skip):
            continue
        parser.add_argument(spec.flag, **spec.argparse_kwargs())
        added.append(spec)
    return added


def option_values(args: Any, door: str, *, only: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """``field -> value`` of the options' flags ``args`` holds at ``door``, only those given (a flag left at
    ``None``, or a launch's switch left off, is the option's default)."""
    wanted = None if only is None else set(only)
    out = {}
    for spec in option_flags(door):
        if wanted is not None and spec.field not in wanted:
            continue
        value = getattr(args, spec.dest, None)
        if value is None or (spec.kind == "switch" and door == "megatron" and value is False
                             and spec.default is not None):
            continue
        out[spec.field] = value
    return out
