"""The one exception type of megarl.config: a bad configuration, named by its dotted key."""


class ConfigError(ValueError):
    """A configuration problem; the message names the full dotted key (and file, if any)."""
