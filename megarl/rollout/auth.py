"""The token rollout servers require: who may generate, pause, abort, replace weights or make
a server join a process group.

On a cluster the servers listen on the nodes' addresses, where every user of the cluster can
reach them. Each run therefore has one token, and every rollout server it starts (stock SGLang
with its ``--api-key``; megarl's embedded server the same way) refuses any request without it,
``/health`` alone excepted (as stock SGLang does, for probes). Every megarl process of the run
holds the token in its environment (``MEGARL_ROLLOUT_API_KEY``), so no call, spec or command
line carries it: the run's clients send it (`SGLangClient`), its servers read it.

Where it comes from, in order: ``actor_rollout_ref.rollout.api_key``; the environment (an
outer launcher's); under torchrun, derived from the job's control secret, so that every rank
computes the same token on its own; otherwise a fresh random one, made by the driver and
handed to Ray's workers with their environment.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"
OPEN_PATHS = ("/health", "/ready", "/metrics")  # stock SGLang's: never behind the key


def api_key() -> str | None:
    """This process's rollout token (None: requests go without one)."""
    return os.environ.get(API_KEY_ENV) or None


def headers(key: str | None = None) -> dict[str, str]:
    """The request headers that carry `key` (None: this process's token), or none."""
    key = key if key is not None else api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def establish(cfg) -> str:
    """Settle the run's token in this process's environment (see the module doc); returns
    it. Call before any worker starts, in every process that `megarl train` starts."""
    from megarl.utils.control_auth import SECRET_ENV

    key = cfg.actor_rollout_ref.rollout.api_key
    if not key:
        key = os.environ.get(API_KEY_ENV)
    if not key and os.environ.get(SECRET_ENV) and cfg.trainer.launcher == "torchrun":
        key = hmac.new(os.environ[SECRET_ENV].encode(), b"megarl rollout api key",
                       hashlib.sha256).hexdigest()
    if not key:
        key = secrets.token_urlsafe(32)
    os.environ[API_KEY_ENV] = key
    return key


def authorized(path: str, header: str | None, key: str | None) -> bool:
    """Whether a request to `path` with this Authorization header may pass, stock SGLang's
    rule (``srt/utils/auth.py`` of 0.5.23, for a server with ``--api-key`` alone): open paths
    always; everything else needs ``Bearer <key>``, compared in constant time."""
    if key is None or path.startswith(OPEN_PATHS):
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())
