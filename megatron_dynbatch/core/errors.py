"""Error types.

Every configuration or input problem raises :class:`DynBatchConfigError`, a ``ValueError`` subclass whose
message always names three things: the offending field (or command-line flag), the value it had, and how to
fix it. Tests match on these parts, so keep the format stable::

    <field>=<value!r>: <problem>. Fix: <fix>

Errors name what the user typed: the planner raises them with its Python keywords (``max_tokens_per_gpu``),
and an entry point whose users type something else re-raises them in its words with :func:`trainer_terms` /
:func:`reword` -- a Megatron launch with the flags (``--max-tokens-per-gpu``), the ``plan`` command with its
flags, a drop-in with its trainer's config names (``max_token_len``).

The trainer drop-ins (:mod:`megatron_dynbatch.integrations`) raise :class:`DropinAssertionError` (and
:class:`OversizeAssertionError`) where the trainer's own function raises ``AssertionError``: one exception that
is both ours (a ``DynBatchConfigError``, so a ``ValueError``) and the trainer's type, so callers and tests
written against the trainer keep catching it.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Iterator, Mapping, Optional


class DynBatchConfigError(ValueError):
    """Bad input or configuration. ``field``, ``value`` and ``fix`` are kept as attributes."""

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


class UnknownOptionError(DynBatchConfigError, TypeError):
    """A keyword that is not a planning option (``plan_global_batch(..., max_token_per_gpu=...)``): a
    ``DynBatchConfigError`` with the close matches, and the ``TypeError`` Python raises for an unknown keyword."""


class OversizeSampleError(DynBatchConfigError):
    """A single sample does not fit the per-micro-batch token budget (policy ``oversize='error'``)."""


class OversizeSampleWarning(UserWarning):
    """Emitted when ``oversize='alone'`` places an over-budget sample in a micro-batch of its own."""


class BudgetWarning(UserWarning):
    """A trainer's configured token budget against what the memory model says fits the card: over it (out of
    memory ahead) or far under it (speed left behind) -- the drop-ins' start-up memory check
    (:mod:`megatron_dynbatch.core.memory.check`). Silence it with
    ``warnings.filterwarnings("ignore", category=BudgetWarning)``."""


class DropinAssertionError(DynBatchConfigError, AssertionError):
    """A drop-in's refusal where the trainer's own function asserts (slime's ``build_dp_schedule``, verl's
    ``seqlen_balancing``, ROLL's ``dynamic_batching_shard``): field, value and fix like every
    ``DynBatchConfigError``, and an ``AssertionError`` like the trainer's."""


class OversizeAssertionError(OversizeSampleError, DropinAssertionError):
    """An over-budget sample where the trainer asserts on it (verl's ``max_token_len`` check, ROLL's padded
    length check)."""


# ------------------------------------------------------------------------------- in the user's words
def _pattern(name: str) -> "re.Pattern[str]":
    return re.compile(rf"(?<![\w\-.\[]){re.escape(name)}(?![\w\-])")


def _rename_field(field: str, words: Mapping[str, str]) -> str:
    for ours, theirs in words.items():
        if field == ours or field.startswith((ours + "[", ours + ".")):
            return theirs + field[len(ours):]
    return field


#: names that are also common English words: renamed as a field, never inside the text
FIELD_ONLY = ("lengths", "model", "parallel")


def _rename_text(text: str, words: Mapping[str, str]) -> str:
    for ours, theirs in words.items():
        if ours not in FIELD_ONLY:
            text = _pattern(ours).sub(theirs, text)
    return text


def in_other_words(text: str, words: Mapping[str, str]) -> str:
    """``text`` with every whole-word mention of our names renamed to ``words``' (as :func:`reword` renames an
    error's problem and fix) -- but not inside a path (``docs/cost_model.md`` stays) nor the :data:`FIELD_ONLY`
    words: e.g. a field's docstring in a door's flags, for that door's ``--help``."""
    for ours, theirs in words.items():
        if ours not in FIELD_ONLY:
            text = re.sub(rf"(?<![\w/.-]){re.escape(ours)}(?![\w/-]|\.\w)", theirs, text)
    return text


def reword(err: DynBatchConfigError, words: Mapping[str, str], *, assertion: bool = False,
           values: Optional[Mapping[str, Any]] = None) -> DynBatchConfigError:
    """``err`` in another vocabulary (``words``: our name -> theirs): the field renamed (``lengths[3]`` ->
    ``total_lengths[3]``), every whole-word mention in the problem and the fix renamed the same way (but the
    :data:`FIELD_ONLY` words); ``values``: their value of a field, by their name; ``assertion=True`` -- where a
    trainer's own function raises ``AssertionError`` -- the type becomes :class:`DropinAssertionError` (or
    :class:`OversizeAssertionError`)."""
    field = _rename_field(err.field, words)
    value = (values or {}).get(field, err.value)
    if isinstance(err, OversizeSampleError):
        cls = OversizeAssertionError if assertion or isinstance(err, AssertionError) else type(err)
    elif assertion and not isinstance(err, AssertionError):
        cls = DropinAssertionError
    else:
        cls = type(err)
    return cls(field, value, _rename_text(err.problem, words), _rename_text(err.fix, words))


@contextlib.contextmanager
def trainer_terms(words: Mapping[str, str], *, assertion: bool = False,
                  values: Optional[Mapping[str, Any]] = None) -> Iterator[None]:
    """Re-raise a ``DynBatchConfigError`` of the block in other words (:func:`reword`)."""
    try:
        yield
    except DynBatchConfigError as err:
        raise reword(err, words, assertion=assertion, values=values).with_traceback(err.__traceback__) from None


def speaks(words: Mapping[str, str], *, assertion: bool = False) -> Callable[[Callable], Callable]:
    """:func:`trainer_terms` around a whole function."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with trainer_terms(words, assertion=assertion):
                return fn(*args, **kwargs)
        return wrapper
    return deco
