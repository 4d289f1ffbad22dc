"""Fuzzing the embedded rollout server's HTTP API: every malformed body gets a 4xx naming its
field, no call hangs, and the server still serves correctly afterwards.

One real server on loopback for the module. The cases are the ones issue 17 found answered
with HTTP 500 or not at all (JSON nested 100k deep, a 5,000-digit integer, `sampling_seed`
2**70, bad ports and backends for `/init_weights_update_group`, `truncate_size` "a word",
rendezvous with ports where nothing listens), plus cases generated from a fixed seed over
every endpoint: fields deleted or nulled, wrong types, NaN and infinities, numbers past 64
bits, deep nesting, unknown fields, truncated JSON, random bytes and bodies over the size
limit. The last tests check that a greedy `/generate` answers as it did before the fuzzing
and that weight updates, from a tensor and over a gloo group, still work.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout.engine import EmbeddedEngine
from megarl.rollout.protocol import short_repr
from megarl.rollout.server import ServerThread
from megarl.rollout.weights import new_update_group, serialize_named_tensors

SEED = 17
GENERATED = 110  # generated cases, on top of the listed ones
TIMEOUT_S = 5.0  # per call: a fuzz case must never be answered by a timeout
GROUP_TIMEOUT_S = 3.0  # the engine's update_group_timeout_s: the rendezvous deadline
MAX_BODY = 1 << 20  # the test server's body limit for everything but tensor updates
PROMPT = [40, 41, 42, 43]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
NORM = "model.norm.weight"


class Raw:
    """JSON text put into a body as is: what json.dumps cannot or will not write."""

    def __init__(self, text: str, label: str):
        self.text, self.label = text, label

    def __repr__(self):
        return self.label


HUGE_INT = Raw("9" * 5000, "int5000digits")
INT_2_70 = Raw(str(2**70), "2**70")
NAN, INF, NINF = Raw("NaN", "NaN"), Raw("Infinity", "inf"), Raw("-Infinity", "-inf")
DEEP = Raw("[" * 40 + "]" * 40, "nested40")
DEEP_100K = Raw("[" * 100_000 + "]" * 100_000, "nested100k")


def render(body) -> bytes:
    """json.dumps with each Raw spliced in by a placeholder."""
    raws: dict[str, str] = {}

    def walk(v):
        if isinstance(v, Raw):
            key = f"@@raw{len(raws)}@@"
            raws[key] = v.text
            return key
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(body))
    for key, raw in raws.items():
        text = text.replace(f'"{key}"', raw)
    return text.encode()


# -- what each field refuses --------------------------------------------------------------------
# Values of the right JSON type that the server accepts are left out of these pools: a case
# must be refused for the field it changes, before the request does anything.
ANY_BAD = [3.5, [], {}, NAN, INF, HUGE_INT, INT_2_70, DEEP]
BAD = {
    "bool": ["a word", 1, 0, "true", *ANY_BAD],
    "str": [1, True, ["a"], *ANY_BAD],
    "int": ["a word", "7", True, NINF, 2**63, *ANY_BAD],
    "str_list": ["a word", [1], [None], [["a"]], 3, True, *ANY_BAD],
    "shapes": ["a word", [[-1]], [[1.5]], ["x"], [[True]], [[2**63]], [[INT_2_70]], 3, DEEP],
    # /generate's batch convention: one value, or a list of one per prompt
    "batch_str": [1, True, [1], ["a", "b"], *ANY_BAD],
    "ids": ["a word", "7", True, 3.5, {}, NAN, INF, HUGE_INT, INT_2_70, DEEP],
    "obj": [],
    "num": ["a word", True, [], {}, NAN, INF, NINF, HUGE_INT, DEEP],
}
FIELD_BAD = {  # range and choice errors of the right type, per field
    "master_address": [""], "master_port": [0, -1, 70000, 2**40],
    "rank_offset": [0, -1, 2, 2**40], "world_size": [1, 0, -3, 2**31],
    "backend": ["bogus", "mpi", ""], "mode": ["later", ""], "selector": ["bogus"],
    "truncate_size": [-1], "logprob_start_len": [0, 5], "top_logprobs_num": [1, 5],
    "stream": [True], "serialized_named_tensors": ["a word", "", ["a", "b"], "QUJD"],
    "input_ids": [[], [-1], [1.5], [True], [10**6], [[]], "a word", {}, [HUGE_INT]],
    "sampling_params": ["a word", 3, [], [GREEDY, GREEDY], True, NAN, HUGE_INT, DEEP],
    "max_new_tokens": [0, -5, 2**63], "min_new_tokens": [-1, 7, 2**63],
    "temperature": [-0.5], "top_p": [0, -0.1, 1.5], "top_k": [0, -2, 2**63],
    "min_p": [-0.1, 1.0], "n": [0, -1, 2**63, 20000],
    "stop_token_ids": [[-1], [1.5], [True], [2**63], ["a"], {}, 5],
    "sampling_seed": [2**63, -(2**63) - 1, INT_2_70, 1.5, "a word", True],
}
NUM_FIELDS = {"temperature", "top_p", "min_p"}


def endpoints(serialized: str) -> dict:
    """path -> (a valid body, {field: kind}, required fields). No valid body is ever sent as
    is: each case breaks one thing in it."""
    greedy = {**GREEDY, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0,
              "n": 1, "stop_token_ids": [1], "sampling_seed": 5, "skip_special_tokens": True,
              "no_stop_trim": False}
    return {
        "/generate": (
            {"input_ids": PROMPT, "sampling_params": greedy, "return_logprob": True,
             "rid": "fuzz", "stream": False, "logprob_start_len": -1, "top_logprobs_num": 0,
             "return_text_in_logprobs": False},
            {"input_ids": "ids", "sampling_params": "obj", "return_logprob": "bool",
             "rid": "batch_str", "stream": "bool", "logprob_start_len": "int",
             "top_logprobs_num": "int", "return_text_in_logprobs": "bool",
             **{f"sampling_params.{k}": ("num" if k in NUM_FIELDS else "ids"
                                         if k == "stop_token_ids" else "bool"
                                         if isinstance(v, bool) else "int")
                for k, v in greedy.items()}},
            {"input_ids"}),
        "/pause_generation": ({"mode": "abort"}, {"mode": "str"}, set()),
        "/continue_generation": ({"torch_empty_cache": False}, {"torch_empty_cache": "bool"},
                                 set()),
        "/abort_request": ({"rid": "nobody", "abort_all": False},
                           {"rid": "str", "abort_all": "bool"}, set()),
        "/init_weights_update_group": (
            {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
             "world_size": 2, "group_name": "fuzz", "backend": "gloo"},
            {"master_address": "str", "master_port": "int", "rank_offset": "int",
             "world_size": "int", "group_name": "str", "backend": "str"},
            {"master_address", "master_port", "rank_offset", "world_size"}),
        "/destroy_weights_update_group": ({"group_name": "none"}, {"group_name": "str"},
                                          set()),
        "/update_weights_from_distributed": (
            {"names": [NORM], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none",
             "flush_cache": False, "abort_all_requests": False, "weight_version": "9",
             "load_format": "flattened_bucket", "selector": "all",
             "torch_empty_cache": False},
            {"names": "str_list", "dtypes": "str_list", "shapes": "shapes",
             "group_name": "str", "flush_cache": "bool", "abort_all_requests": "bool",
             "weight_version": "str", "load_format": "str", "selector": "str",
             "torch_empty_cache": "bool"},
            {"names", "dtypes", "shapes"}),
        "/update_weights_from_tensor": (
            {"serialized_named_tensors": [serialized], "load_format": None,
             "flush_cache": False, "weight_version": "9", "abort_all_requests": False,
             "selector": "all", "torch_empty_cache": False},
            {"serialized_named_tensors": "str", "load_format": "str", "flush_cache": "bool",
             "weight_version": "str", "abort_all_requests": "bool", "selector": "str",
             "torch_empty_cache": "bool"},
            {"serialized_named_tensors"}),
        "/begin_weight_update": ({"selector": "all"}, {"selector": "str"}, set()),
        "/end_weight_update": ({}, {}, set()),
        "/update_weight_version": ({"new_version": "v0", "abort_all_requests": False},
                                   {"new_version": "str", "abort_all_requests": "bool"},
                                   {"new_version"}),
        "/get_weights_by_name": ({"name": NORM, "truncate_size": 4},
                                 {"name": "str", "truncate_size": "int"}, {"name"}),
        "/weights_checker": ({"action": "checksum", "allow_quant_error": False,
                              "skip_tensor_list": [], "selector": "all"},
                             {"action": "str", "allow_quant_error": "bool",
                              "skip_tensor_list": "str_list", "selector": "str"}, set()),
    }


def set_field(body: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(body))
    *parents, key = path.split(".")
    node = out
    for p in parents:
        node = node[p]
    node[key] = value
    return out


def drop_field(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


def generated_cases(templates: dict) -> list[tuple]:
    """(id, path, raw body, expected status, expected field), from a fixed seed."""
    rng = random.Random(SEED)
    paths = sorted(templates)
    cases = []
    for i in range(GENERATED):
        path = rng.choice(paths)
        body, fields, required = templates[path]
        how = rng.choice(["value", "value", "value", "drop", "unknown", "bytes", "truncate",
                          "not_object"])
        if how == "drop" and not required:
            how = "value"
        if how == "value" and not fields:
            how = "unknown"
        if how == "value":
            field = rng.choice(sorted(fields))
            name = field.split(".")[-1]
            value = rng.choice(FIELD_BAD.get(name, []) + BAD[fields[field]])
            raw = render(set_field(body, field, value))
            cases.append((f"{path}-{field}={value!r:.40}#{i}", path, raw, 400, field))
        elif how == "drop":
            field = rng.choice(sorted(required))
            nulled = rng.random() < 0.5
            b = set_field(body, field, None) if nulled else drop_field(body, field)
            cases.append((f"{path}-{'null' if nulled else 'no'}-{field}#{i}", path, render(b), 400,
                          field))
        elif how == "unknown":
            key = rng.choice(["frobnicate", "sampling", "Names", "weight-version", "x" * 300])
            cases.append((f"{path}-unknown-{key[:12]}#{i}", path, render({**body, key: 1}),
                          400, short_repr(key, 64, quote=False)))
        elif how == "bytes":
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            if not raw.strip():  # whitespace alone is an empty body, a valid request for some
                raw = b"\x00" + raw
            cases.append((f"{path}-bytes{i}", path, raw, 400, "body"))
        elif how == "truncate":
            text = render(body)
            cut = rng.randrange(1, len(text))
            cases.append((f"{path}-truncated@{cut}#{i}", path, text[:cut], 400, "body"))
        else:
            raw = rng.choice([b"[1, 2]", b'"a word"', b"42", b"null", b"true", b"[{}]"])
            cases.append((f"{path}-toplevel-{raw[:8].decode()}#{i}", path, raw, 400, "body"))
    return cases


def listed_cases(templates: dict) -> list[tuple]:
    """The cases issue 17 lists, and one per endpoint for the empty and the non-JSON body."""
    gen = templates["/generate"][0]
    init = templates["/init_weights_update_group"][0]
    cases = [
        ("nested-100k-deep", "/generate", DEEP_100K.text.encode(), 400, "body"),
        ("nested-100k-deep-in-field", "/generate",
         render({**gen, "input_ids": DEEP_100K}), 400, "body"),
        ("nested-40-deep-in-field", "/generate",
         render(set_field(gen, "sampling_params.stop_token_ids", DEEP)), 400,
         "sampling_params.stop_token_ids"),
        ("int-5000-digits", "/generate", render({**gen, "input_ids": [HUGE_INT]}), 400,
         "input_ids"),
        ("int-5000-digits-top-k", "/generate",
         render(set_field(gen, "sampling_params.top_k", HUGE_INT)), 400,
         "sampling_params.top_k"),
        ("sampling-seed-2**70", "/generate",
         render(set_field(gen, "sampling_params.sampling_seed", 2**70)), 400,
         "sampling_params.sampling_seed"),
        ("sampling-seed-2**63", "/generate",
         render(set_field(gen, "sampling_params.sampling_seed", 2**63)), 400,
         "sampling_params.sampling_seed"),
        ("temperature-nan", "/generate",
         render(set_field(gen, "sampling_params.temperature", NAN)), 400,
         "sampling_params.temperature"),
        ("top-p-inf", "/generate", render(set_field(gen, "sampling_params.top_p", INF)), 400,
         "sampling_params.top_p"),
        ("prompt-over-context", "/generate", render({**gen, "input_ids": [40] * 150_000}),
         400, "input_ids"),
        ("port-a-word", "/init_weights_update_group",
         render({**init, "master_port": "a word"}), 400, "master_port"),
        ("port--1", "/init_weights_update_group", render({**init, "master_port": -1}), 400,
         "master_port"),
        ("port-70000", "/init_weights_update_group", render({**init, "master_port": 70000}),
         400, "master_port"),
        ("backend-bogus", "/init_weights_update_group", render({**init, "backend": "bogus"}),
         400, "backend"),
        ("backend-nccl-on-cpu", "/init_weights_update_group",
         render({**init, "backend": "nccl"}), 400, "backend"),
        ("truncate-size-a-word", "/get_weights_by_name",
         render({"name": NORM, "truncate_size": "a word"}), 400, "truncate_size"),
        ("truncate-size-whole-tensors", "/get_weights_by_name",
         render({"name": NORM, "truncate_size": 10 ** 9}), 400, "truncate_size"),
        ("weights-unknown-name", "/get_weights_by_name", render({"name": "nope"}), 400,
         "name"),
        ("unknown-sampling-param", "/generate",
         render(set_field(gen, "sampling_params.temprature", 1.0)), 400,
         "sampling_params.temprature"),
        ("n-over-the-per-call-cap", "/generate", render(set_field(gen, "sampling_params.n",
                                                                  10**6)), 400,
         "sampling_params.n"),
    ]
    for path, (body, fields, required) in sorted(templates.items()):
        if required:
            first = [k for k in body if k in required][0]
            cases.append((f"{path}-empty-body", path, b"", 400, first))
        cases.append((f"{path}-not-json", path, b"{not json", 400, "body"))
        cases.append((f"{path}-non-utf8", path, b'{"a": "\xff\xfe"}', 400, "body"))
    return cases


# -- the server ----------------------------------------------------------------------------------
def request(url_port: int, method: str, path: str, raw: bytes | None = None,
            timeout: float = TIMEOUT_S) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=timeout)
    try:
        conn.request(method, path, body=raw,
                     headers={"Content-Type": "application/json"} if raw is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body, timeout: float = TIMEOUT_S):
    status, raw = request(port, "POST", path, render(body), timeout)
    return status, (json.loads(raw) if raw else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(qwen_dir):
    engine = EmbeddedEngine(qwen_dir, weight_version="v0", load_tokenizer=False,
                            update_group_timeout_s=GROUP_TIMEOUT_S)
    with ServerThread(engine, max_body_bytes=MAX_BODY) as srv:
        status, out = post_json(srv.port, "/generate", {"input_ids": PROMPT,
                                                        "sampling_params": GREEDY})
        assert status == 200, out
        srv.baseline = out["output_ids"]  # greedy output before any fuzzing
        yield srv


@pytest.fixture(scope="module")
def norm_update(qwen_dir_b):
    return [(NORM, load_file(str(qwen_dir_b / "model.safetensors"))[NORM])]


# The case lists are built at collection time; the serialized tensor in the update template
# only has to be valid base64 torch.save data, so a stand-in of the right shape serves.
_TEMPLATES = endpoints(serialize_named_tensors([(NORM, torch.ones(64))]))
CASES = listed_cases(_TEMPLATES) + generated_cases(_TEMPLATES)


def test_case_count_and_coverage():
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} == set(_TEMPLATES)  # every endpoint that reads a body


@pytest.mark.parametrize("path, raw, want_status, want_field",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_body_gets_4xx_naming_the_field(server, path, raw, want_status, want_field):
    t0 = time.monotonic()
    status, out = request(server.port, "POST", path, raw)
    assert status == want_status, out[:500]
    err = json.loads(out)["error"]
    assert err["field"] == want_field, err
    assert want_field in err["message"]
    # Everything here is refused before any connection or engine work.
    assert time.monotonic() - t0 < 2.0


def _send_raw(port: int, head: bytes, chunks) -> tuple[int, dict]:
    """Send `head`, then `chunks` until the server answers and closes; its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
        s.sendall(head)
        try:
            for chunk in chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read what it said
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, json.loads(resp.read())


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_tensor"])
def test_declared_huge_body_is_refused_before_it_is_read(server, path):
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10**12}\r\n\r\n").encode()
    status, out = _send_raw(server.port, head, [b'{"input_ids": ['])
    assert status == 413 and out["error"]["field"] == "body", out


def test_chunked_body_over_the_limit_is_refused(server):
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"9" * (256 << 10)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    status, out = _send_raw(server.port, head, [chunk] * 8)  # 2 MiB against a 1 MiB limit
    assert status == 413 and out["error"]["field"] == "body", out


def test_rendezvous_has_a_deadline_and_blocks_no_other_call(server, norm_update):
    """Inits towards ports where nothing listens, a port that accepts and never answers, and
    the server's own HTTP port, all at once: each is answered with a 400 naming master_port
    within the deadline; meanwhile health, generation and a tensor update are answered at
    once (none waits on a thread or lock a rendezvous holds)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    ports = [free_port() for _ in range(8)] + [silent.getsockname()[1], server.port]
    base = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}
    pool = concurrent.futures.ThreadPoolExecutor(len(ports) + 1)
    try:
        t0 = time.monotonic()
        inits = [pool.submit(post_json, server.port, "/init_weights_update_group",
                             {**base, "master_port": p, "group_name": f"dead{i}"},
                             GROUP_TIMEOUT_S + 5) for i, p in enumerate(ports)]
        time.sleep(0.5)  # let every rendezvous start
        # The same group name again while its rendezvous is under way: refused at once.
        status, out = post_json(server.port, "/init_weights_update_group",
                                {**base, "master_port": ports[0], "group_name": "dead0"})
        assert status == 400 and out["error"]["field"] == "group_name", out
        assert request(server.port, "GET", "/health", timeout=1.0)[0] == 200
        status, out = post_json(server.port, "/generate", {"input_ids": PROMPT,
                                                           "sampling_params": GREEDY})
        assert status == 200 and out["output_ids"] == server.baseline
        data = serialize_named_tensors(norm_update)
        for path, body in [("/begin_weight_update", {}),
                           ("/update_weights_from_tensor",
                            {"serialized_named_tensors": [data], "flush_cache": False,
                             "weight_version": "v1"}),
                           ("/end_weight_update", {})]:
            status, out = post_json(server.port, path, body, timeout=2.0)
            assert status == 200, (path, out)
        assert time.monotonic() - t0 < GROUP_TIMEOUT_S  # all the above while inits wait
        answers = [f.result() for f in inits]
        elapsed = time.monotonic() - t0
    finally:
        pool.shutdown(wait=False)
        silent.close()
    for status, out in answers:
        assert status == 400 and out["error"]["field"] == "master_port", out
    assert elapsed < GROUP_TIMEOUT_S + 3
    status, weights = post_json(server.port, "/get_weights_by_name", {"name": NORM,
                                                                      "truncate_size": 64})
    assert torch.allclose(torch.tensor(weights), norm_update[0][1])


def test_server_still_serves_after_the_fuzzing(server, qwen_dir, norm_update):
    """Health, the pre-fuzz greedy output once the original weights are back, and a weight
    update over a real gloo group with the trainer's side in this process."""
    assert request(server.port, "GET", "/health")[0] == 200
    port, name = free_port(), "fuzz-final"
    original = load_file(str(qwen_dir / "model.safetensors"))[NORM].contiguous()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        # The engine's join blocks until the trainer (rank 0, here) joins too.
        init = pool.submit(post_json, server.port, "/init_weights_update_group",
                           {"master_address": "127.0.0.1", "master_port": port,
                            "rank_offset": 1, "world_size": 2, "group_name": name,
                            "backend": "gloo"})
        group = new_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=30)
        assert init.result()[0] == 200, init.result()
        assert post_json(server.port, "/begin_weight_update", {})[0] == 200
        update = pool.submit(post_json, server.port, "/update_weights_from_distributed",
                             {"names": [NORM], "dtypes": ["float32"], "shapes": [[64]],
                              "group_name": name, "flush_cache": False,
                              "weight_version": "v2"})
        group.broadcast(original, 0)
        assert update.result()[0] == 200, update.result()
        assert post_json(server.port, "/end_weight_update", {})[0] == 200
        assert post_json(server.port, "/destroy_weights_update_group",
                         {"group_name": name})[0] == 200
        group.close()
    finally:
        pool.shutdown(wait=False)
    status, out = post_json(server.port, "/generate", {"input_ids": PROMPT,
                                                       "sampling_params": GREEDY})
    assert status == 200 and out["output_ids"] == server.baseline
    assert out["meta_info"]["weight_version"] == "v2"
    status, weights = post_json(server.port, "/get_weights_by_name", {"name": NORM,
                                                                      "truncate_size": 64})
    assert torch.equal(torch.tensor(weights), original)
