"""The one exception type of megarl.config: a bad configuration, named by its dotted key.

Defined in `megarl.utils.errors` (the packages below the config raise it too); it is
`megarl.config`'s own error as far as its users are concerned."""

from megarl.utils.errors import ConfigError

__all__ = ["ConfigError"]
