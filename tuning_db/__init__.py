"""Storage of tuning results: the database, shipped table files, and which stored entry answers a lookup."""

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import tuning_db` in a checkout is `kreg.tuning_db`
