"""Error types shared by every layer of megarl.

`ConfigError` lives here, below every package, so that the packages the config reads from
(data, reward, observability, cluster) can raise it without importing `megarl.config`, which
imports them in turn to check a configuration before any work starts.
"""


class ConfigError(ValueError):
    """A configuration problem; the message names the full dotted key (and file, if any)."""
