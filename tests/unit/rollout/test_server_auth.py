"""A rollout server with the run's token (megarl.rollout.auth) does nothing for a caller
without it: weight updates, pauses, group joins, aborts, generation and weight reads answer
401 before their bodies are read, and the engine is as it was; /health stays open (stock
SGLang's rule for `--api-key`); megarl's client brings the token and is served."""
import asyncio

import aiohttp
import pytest

from megarl.backends.sglang.client import SGLangClient
from megarl.rollout import auth as rollout_auth
from megarl.rollout.server import ServerThread

KEY = "k" * 43

REFUSED = [("POST", "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
             "group_name": "g", "weight_version": "evil"}),
           ("POST", "/update_weight_version", {"new_version": "evil"}),
           ("POST", "/pause_generation", {}),
           ("POST", "/init_weights_update_group",
            {"master_address": "203.0.113.9", "master_port": 9, "rank_offset": 1,
             "world_size": 2, "group_name": "g", "backend": "gloo"}),
           ("POST", "/abort_request", {"abort_all": True}),
           ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
           ("GET", "/get_weights_by_name", {"name": "model.norm.weight"}),
           ("GET", "/model_info", None)]


def test_without_the_token_nothing_is_done_and_with_it_all_is(engine):
    async def go(url):
        async with aiohttp.ClientSession() as s:
            status = {}
            for method, path, body in REFUSED:
                for header in (None, "Bearer wrong", f"Basic {KEY}", KEY):
                    h = {"Authorization": header} if header else {}
                    async with s.request(method, url + path, json=body, headers=h) as r:
                        status[path, header] = (r.status, await r.json())
            async with s.get(url + "/health") as r:
                health = r.status
        return status, health

    with ServerThread(engine, api_key=KEY) as server:
        status, health = asyncio.run(go(server.url))
        assert {v[0] for v in status.values()} == {401}
        assert all(v[1] == {"error": "Unauthorized"} for v in status.values())
        assert health == 200
        assert engine.weight_version == "0" and not engine.paused
        assert not engine._groups and not engine._joining

        async def authed():
            async with SGLangClient(server.url, api_key=KEY) as c:
                await c.pause_generation()
                await c.continue_generation()
                return (await c.model_info())["weight_version"]
        assert asyncio.run(authed()) == "0"


def test_the_clients_and_servers_of_a_run_share_its_token_from_the_environment(
        engine, monkeypatch):
    from megarl.config import load_config

    monkeypatch.delenv(rollout_auth.API_KEY_ENV, raising=False)
    monkeypatch.delenv("MEGARL_CONTROL_SECRET", raising=False)
    made = rollout_auth.establish(load_config(None, []))
    assert len(made) >= 40 and rollout_auth.api_key() == made
    # torchrun: every rank derives the same token from the job's secret, never sent anywhere
    monkeypatch.delenv(rollout_auth.API_KEY_ENV)
    monkeypatch.setenv("MEGARL_CONTROL_SECRET", "s" * 64)
    cfg = load_config(None, ["trainer.launcher=torchrun"])
    first = rollout_auth.establish(cfg)
    monkeypatch.delenv(rollout_auth.API_KEY_ENV)
    assert rollout_auth.establish(cfg) == first != made
    # the config's key wins (the --api-key of servers the user runs)
    cfg = load_config(None, ["trainer.launcher=torchrun",
                             f"actor_rollout_ref.rollout.api_key={KEY}"])
    assert rollout_auth.establish(cfg) == KEY == rollout_auth.api_key()

    async def go(url):
        async with SGLangClient(url) as c:  # the token from the environment
            return (await c.model_info())["weight_version"]

    with ServerThread(engine) as server:  # the token from the environment
        assert asyncio.run(go(server.url)) == "0"
        with pytest.raises(Exception, match="401"):
            asyncio.run(SGLangClient(server.url, api_key="other").model_info())
