"""Click parameter types shared by the command-line tools (peer/cli.py, bootstrap/cli.py)."""

from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """:class:`click.FloatRange` that also refuses ``nan`` and ``inf``.

    ``float("nan")`` compares false with every bound, so a plain FloatRange lets ``--flag nan``
    through to a config check that raises deep inside the command; this fails at the flag instead,
    as a usage error (exit 2) naming the value and the range to give.
    """

    name = "finite float range"

    def convert(self, value, param, ctx) -> float:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number: give one in the range {self._describe_range()}.", param, ctx)
        return rv
