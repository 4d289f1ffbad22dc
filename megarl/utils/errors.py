"""Error types shared by every layer of megarl.

`ConfigError` lives here, below every package, so that the packages the config reads from
(data, reward, observability, cluster) can raise it without importing `megarl.config`, which
imports them in turn to check a configuration before any work starts.
"""


class ConfigError(ValueError):
    """A configuration problem; the message names the full dotted key (and file, if any)."""


def lost_too_often(losses: list[str], limit: int) -> str:
    """The message of a run that stops because it was lost once more than
    `trainer.max_restarts` allows: every loss, in order (the driver under Ray, the last
    torchrun life under torchrun)."""
    return (f"the run was lost {len(losses)} times, past trainer.max_restarts={limit}: "
            + "; ".join(f"({i + 1}) {w}" for i, w in enumerate(losses)))
