"""How the tuning database reports what went wrong without giving its password away.

`TuningDatabaseError` is the one error the store raises for a database it cannot use. Every message
and warning about a database names it through `safe_url` (the URL with its password hidden, even when
the URL does not parse) and passes its text through `redact` (which cuts the password out of whatever
a driver wrote); `one_line` keeps a long driver or pydantic message to one readable line.
"""

from __future__ import annotations

import re

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url


class TuningDatabaseError(RuntimeError, ValueError):
    """The tuning database cannot be used: a URL that does not parse or whose driver is missing, a damaged
    file or one that is not a database, a read-only file written to, a server that refuses. The message
    names the database without its password."""


# The user part of a URL: from the scheme's "://" (or the start) to the last "@". For a URL that does
# not parse, this is all we can tell apart.
_USER_INFO = re.compile(r"^(?P<scheme>[A-Za-z0-9+.-]*://)?(?P<user>.*)@")
# Query parameters that carry a secret (libpq and its drivers take `password=` there too).
_SECRET_NAME = re.compile(r"pass|secret|token", re.IGNORECASE)
_QUERY_SECRET = re.compile(r"(?P<name>[?&][^=&#]*(?:pass|secret|token)[^=&#]*=)(?P<value>[^&#]*)", re.IGNORECASE)
# What splits an unescaped password when a parser misreads it; each piece may reach an error message.
_DELIMITERS = re.compile(r"[@:/?#&=]")


def safe_url(url: str) -> str:
    """`url` as it may be shown: SQLAlchemy's rendering with the password hidden, or, for a URL that does
    not parse, the whole user part replaced by ***; secret query parameters (password=...) as ***."""
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError, TypeError):
        shown = _USER_INFO.sub(lambda m: f"{m['scheme'] or ''}***@", str(url), count=1)
    return _QUERY_SECRET.sub(lambda m: f"{m['name']}***", shown)


def _secrets(url: str) -> set[str]:
    """Every spelling of `url`'s secrets that a message may hold: the password as SQLAlchemy reads it and
    as the user part spells it, the pieces of an unescaped one (a parser that misreads it quotes pieces),
    and secret query parameters."""
    url = str(url)
    found = set()
    try:
        parsed = make_url(url)
        if parsed.password:
            found.add(str(parsed.password))
        for name, value in parsed.query.items():
            if _SECRET_NAME.search(name):
                found.update([value] if isinstance(value, str) else value)
    except (sa_exc.ArgumentError, ValueError, TypeError):
        pass
    user = _USER_INFO.match(url)
    if user and ":" in user["user"]:
        found.add(user["user"].split(":", 1)[1])
    found.update(m["value"] for m in _QUERY_SECRET.finditer(url))
    pieces = {piece for secret in found for piece in _DELIMITERS.split(secret) if len(piece) >= 2}
    return (found | pieces) - {""}


def redact(text: str, url: str) -> str:
    """`text` (an error message, say) with every spelling of `url`'s secrets replaced by ***."""
    for secret in sorted(_secrets(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def one_line(err: BaseException) -> str:
    """`err`'s message on one line of at most 300 characters (pydantic's span lines and end with a link;
    what went wrong is kept)."""
    lines = [line.strip() for line in str(err).splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith("For further information"))
    return text if len(text) <= 300 else text[:297] + "..."
