"""Signed messages for torchrun's control plane (cluster/torchrun.py).

Rank 0 sends each rank its commands, and each rank its results, as pickles through a TCPStore.
That store is torchrun's agent's: it listens on every interface of node 0 (torch gives it no
address to bind) and checks no credential, so anyone who reaches MASTER_PORT can read and write
its keys. Unpickling what such a person wrote would run their code as the job's user, on every
rank. So every value is sealed: an HMAC-SHA256, under a secret of the job's, over the key it is
stored at and the pickle's bytes. A value whose MAC does not verify is refused before any byte
of it is unpickled.

The secret reaches the ranks through the environment (``MEGARL_CONTROL_SECRET``), never
through the store: launch/torchrun.sh makes one for a one-node job, and a multi-node job must
give every node the same one (docs/security.md). Binding the key (which holds the run id and the
life) keeps a sealed value from being replayed at another key.

What this leaves open, deliberately: someone who reaches the store can still read the values
(batches of token ids, config-derived arguments: nothing secret) and delete or overwrite keys,
which stalls the run until its deadlines fail it; they cannot make a rank run anything.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle

from megarl.utils.errors import ConfigError

SECRET_ENV = "MEGARL_CONTROL_SECRET"
MIN_SECRET_CHARS = 32
_MAC_BYTES = hashlib.sha256().digest_size


class ForgedMessage(ValueError):
    """A control-plane value that is not sealed with this job's secret."""


class Sealer:
    """Seals and opens control-plane values under one job's secret."""

    def __init__(self, secret: str):
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"{SECRET_ENV}: {len(secret)} characters; give at least "
                              f"{MIN_SECRET_CHARS} (e.g. python -c 'import secrets; "
                              f"print(secrets.token_hex(32))')")
        self._key = secret.encode()

    @classmethod
    def from_env(cls) -> "Sealer":
        secret = os.environ.get(SECRET_ENV)
        if not secret:
            raise ConfigError(
                f"trainer.launcher=torchrun: {SECRET_ENV} is not set. The ranks sign every "
                "command with it (the store torchrun hosts takes writes from anyone who "
                "reaches it); launch/torchrun.sh makes one for a one-node job, and a multi-node "
                "job must export the same one on every node (docs/security.md)")
        return cls(secret)

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + payload, hashlib.sha256).digest()

    def seal(self, key: str, obj) -> bytes:
        """`obj` pickled, as the value of store key `key` (its full name, prefix included)."""
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        return self._mac(key, payload) + payload

    def open(self, key: str, value: bytes):
        """The object sealed at `key`; `ForgedMessage` if it was not sealed there under this
        secret (nothing of it is unpickled then)."""
        mac, payload = bytes(value[:_MAC_BYTES]), bytes(value[_MAC_BYTES:])
        if len(value) <= _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ForgedMessage(f"{key}: {len(value)} bytes not signed with this job's "
                                f"{SECRET_ENV}")
        return pickle.loads(payload)
