"""The one error type a user ever sees from bamgen.

Every mistake in a prior file (a bad field, an unknown symbol, a formula that is not finite) is
raised as a :class:`SpecError` that names the file, the field, the line when known, and a
one-line hint on how to fix it. The CLI prints ``str(err)`` and exits with status 2.
"""
from __future__ import annotations


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
        where = self.file or "<prior>"
        if self.line is not None:
            where += f":{self.line}"
        field = f" field '{self.field}':" if self.field else ""
        hint = f" (hint: {self.hint})" if self.hint else ""
        return f"{where}:{field} {self.message}{hint}"
