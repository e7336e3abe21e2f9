"""The one error type a user ever sees from bamgen, and the one warning.

Every mistake in a prior file (a bad field, an unknown symbol, a formula that is not finite) is
raised as a :class:`SpecError` that names the file, the field, the line when known, and a
one-line hint on how to fix it. The CLI prints ``str(err)`` and exits with status 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


class SpecError(ValueError):
    """A prior file that bamgen refuses, with where and how to fix it."""

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None,
                 line: int | None = None, hint: str | None = None):
        self.message = message
        self.field = field
        self.file = file
        self.line = line
        self.hint = hint
        super().__init__(str(self))

    def located(self, file: str) -> "SpecError":
        """Return the same error with the file name filled in (stages below spec do not know it)."""
        return SpecError(self.message, field=self.field, file=self.file or file,
                         line=self.line, hint=self.hint)

    def __str__(self) -> str:
        return _located_text(self.file, self.line, self.field, self.message, self.hint)


@dataclass(frozen=True)
class SpecWarning:
    """A prior file that builds but holds something its author likely did not mean (a learnable
    parameter that gets no gradient): the build prints it, bamgen.load warns with it
    (PriorWarning), `bamgen show` lists it. Never a refusal: the module is right as written."""
    message: str
    field: str | None = None
    line: int | None = None
    hint: str | None = None
    file: str | None = None

    def located(self, file: str) -> "SpecWarning":
        return replace(self, file=self.file or file)

    def __str__(self) -> str:
        return _located_text(self.file, self.line, self.field, self.message, self.hint)


class PriorWarning(UserWarning):
    """The Python warning bamgen.load gives for each SpecWarning of the prior it builds."""


def _located_text(file, line, field, message, hint) -> str:
    """FILE[:LINE]: field 'FIELD': message (hint: ...), as the CLI prints it."""
    where = file or "<prior>"
    if line is not None:
        where += f":{line}"
    field = f" field '{field}':" if field else ""
    hint = f" (hint: {hint})" if hint else ""
    return f"{where}:{field} {message}{hint}"
