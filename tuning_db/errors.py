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


def safe_url(url: str) -> str:
    """`url` as it may be shown: SQLAlchemy's rendering with the password hidden, or, for a URL that does
    not parse, the whole user part replaced by ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError, TypeError):
        return _USER_INFO.sub(lambda m: f"{m['scheme'] or ''}***@", str(url), count=1)


def redact(text: str, url: str) -> str:
    """`text` (an error message, say) with every spelling of `url`'s password replaced by ***."""
    secrets = set()
    try:
        password = make_url(url).password
        if password:
            secrets.add(str(password))
    except (sa_exc.ArgumentError, ValueError, TypeError):
        pass
    found = _USER_INFO.match(str(url))
    if found and ":" in found["user"]:
        secrets.add(found["user"].split(":", 1)[1])
    for secret in sorted(secrets - {""}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def one_line(err: BaseException) -> str:
    """`err`'s message on one line of at most 300 characters (pydantic's span lines and end with a link;
    what went wrong is kept)."""
    lines = [line.strip() for line in str(err).splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith("For further information"))
    return text if len(text) <= 300 else text[:297] + "..."
