"""Reading a command line's numbers for the launch rules (:mod:`helpers.calc.mesh`, :mod:`helpers.calc.pipeline`,
:mod:`helpers.calc.cp`): one reading of a whole-number flag, and the divisors a message offers instead. A leaf
module: the rule modules import it, and mesh imports them, so it imports none of them.

    >>> whole("--tp", "3"), whole("--tp", "0"), divisors(12)
    (3, '--tp must be at least 1, got 0', '1, 2, 3, 4, 6, 12')
"""
from __future__ import annotations


def whole(flag: str, value) -> int | str:
    """``value`` as a whole number >= 1, or the problem with it, in words."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return f"{flag} must be a whole number, got {value!r}"
    return number if number >= 1 else f"{flag} must be at least 1, got {number}"


def divisors(n: int, keep=lambda d: True) -> str:
    """The divisors of ``n`` (those ``keep`` accepts), as a message lists them: "1, 2, 4"."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and keep(d))
