"""The contract checker itself: it must fail on what stock SGLang would drop or reject, and
pass what it reads. (If these pass vacuously, every contract test built on it does too.)"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megarl.backends.sglang import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[2]

UPDATE = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g",
          "flush_cache": False}


def test_fixture_is_the_pinned_release(stock_sglang):
    assert stock_sglang.version == SGLANG_VERSION
    assert hasattr(stock_sglang.api, "GenerateRequest")


def test_weight_update_fields_are_the_releases(stock_sglang):
    assert stock_sglang.request_fields("/update_weights_from_distributed") == {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
        "weight_version", "load_format", "selector", "torch_empty_cache"}
    assert stock_sglang.request_fields("/end_weight_update") == set()
    assert stock_sglang.request_fields("/pause_generation") == {"mode"}
    assert stock_sglang.request_class("/generate") is stock_sglang.api.GenerateRequest
    assert stock_sglang.request_class("/abort_request") is stock_sglang.api.AbortRequest
    assert stock_sglang.request_class("/flush_cache") is None  # query parameter only
    assert stock_sglang.query_params("/flush_cache") == {"timeout"}


def test_good_bodies_pass(stock_sglang):
    check = stock_sglang.check_request
    check("/update_weights_from_distributed", UPDATE)
    check("/update_weights_from_distributed",
          {**UPDATE, "load_format": "flattened_bucket", "weight_version": "3"})
    check("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                         "rank_offset": 1, "world_size": 3,
                                         "group_name": "g", "backend": "nccl"})
    check("/update_weights_from_tensor", {"serialized_named_tensors": ["AAEC"],
                                          "load_format": None, "flush_cache": True})
    check("/begin_weight_update", {})
    check("/end_weight_update", {})
    check("/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    check("/pause_generation", {"mode": "retract"})
    check("/continue_generation", {})
    check("/flush_cache", None)
    check("/abort_request", {"rid": "req-1", "abort_all": False})
    check("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 4})
    check("/generate", {"input_ids": [[1, 2], [3]], "return_logprob": True, "rid": ["a", "b"],
                        "sampling_params": [{"temperature": 0.7, "max_new_tokens": 8,
                                             "sampling_seed": 1},
                                            {"top_p": 0.9, "stop_token_ids": [2]}]})


def test_unknown_field_fails_naming_endpoint_and_field(stock_sglang):
    with pytest.raises(AssertionError, match=r"/update_weights_from_distributed.*`frobnicate`"):
        stock_sglang.check_request("/update_weights_from_distributed",
                                   {**UPDATE, "frobnicate": 1})


def test_megarl_bucket_extension_fails(stock_sglang):
    body = {**UPDATE, "load_format": "megarl_bucket", "bucket": {"offsets": [0], "nbytes": 12}}
    with pytest.raises(AssertionError, match=r"/update_weights_from_distributed.*`bucket`"):
        stock_sglang.check_request("/update_weights_from_distributed", body)


def test_weight_version_on_end_weight_update_fails(stock_sglang):
    with pytest.raises(AssertionError, match=r"/end_weight_update.*`weight_version`"):
        stock_sglang.check_request("/end_weight_update", {"weight_version": "3"})


def test_literal_value_outside_fails(stock_sglang):
    with pytest.raises(AssertionError, match=r"/pause_generation.*`mode`.*bogus"):
        stock_sglang.check_request("/pause_generation", {"mode": "bogus"})
    with pytest.raises(AssertionError, match="selector"):
        stock_sglang.check_request("/begin_weight_update", {"selector": "both"})


def test_wrong_json_types_and_missing_fields_fail(stock_sglang):
    check = stock_sglang.check_request
    with pytest.raises(AssertionError, match="`shapes`"):
        check("/update_weights_from_distributed", {**UPDATE, "shapes": [["2", "3"]]})
    with pytest.raises(AssertionError, match="`master_port`"):
        check("/init_weights_update_group", {"master_address": "a", "master_port": "29500",
                                             "rank_offset": 0, "world_size": 2})
    with pytest.raises(AssertionError, match="`names`"):
        check("/update_weights_from_distributed", {"dtypes": ["bfloat16"], "shapes": [[1]]})
    with pytest.raises(AssertionError, match="/generate"):  # api_types' JsonContractError
        check("/generate", {"input_ids": "not tokens"})


def test_sampling_params_are_checked_recursively(stock_sglang):
    check = stock_sglang.check_request
    with pytest.raises(AssertionError, match=r"/generate.*`seed`"):
        check("/generate", {"input_ids": [1], "sampling_params": {"seed": 1}})
    with pytest.raises(AssertionError, match=r"/generate.*`logprobs`.*sampling_params\[1\]"):
        check("/generate", {"input_ids": [[1], [2]],
                            "sampling_params": [{"temperature": 1.0}, {"logprobs": 2}]})
    with pytest.raises(AssertionError, match=r"/generate.*`weight_version`"):
        check("/generate", {"input_ids": [1], "weight_version": "3"})


def test_generate_fields_only_the_handler_reads_are_checked_with_its_class(stock_sglang):
    """`return_routed_experts` is read by GenerateReqInput, not by the API types (whose gate
    passes it on); routed_experts_start_len by both."""
    check = stock_sglang.check_request
    check("/generate", {"input_ids": [1], "return_routed_experts": True,
                        "routed_experts_start_len": 0})
    with pytest.raises(AssertionError, match=r"/generate.*`return_routed_experts`"):
        check("/generate", {"input_ids": [1], "return_routed_experts": [True]})
    with pytest.raises(AssertionError, match=r"/generate.*expected i64"):  # the gate's text
        check("/generate", {"input_ids": [1], "routed_experts_start_len": "1"})


def test_bodies_where_none_is_read_and_unknown_endpoints_fail(stock_sglang):
    with pytest.raises(AssertionError, match=r"/flush_cache.*`timeout_s`"):
        stock_sglang.check_request("/flush_cache", {"timeout_s": 1.0})
    with pytest.raises(AssertionError, match="serves no endpoint /update_weights_bucketed"):
        stock_sglang.check_request("/update_weights_bucketed", {})


def test_generate_response_decodes_with_weight_version_spans(stock_sglang):
    body = {"text": "", "output_ids": [1],
            "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 1},
                          "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                          "output_token_logprobs": [[-0.1, 1, None]]}}
    resp = stock_sglang.check_response("/generate", body)
    meta = resp.meta_info
    assert resp.output_ids == [1]
    assert [(s.version, s.start, s.end) for s in meta.weight_versions] == [("1", 0, 1)]
    assert (meta.output_token_logprobs[0].logprob, meta.output_token_logprobs[0].token_id) == (
        -0.1, 1)
    assert isinstance(meta.finish_reason, stock_sglang.api.FinishLength)
    assert meta.finish_reason.length == 1
    batch = stock_sglang.check_response("/generate", [body, body])
    assert len(batch) == 2 and batch[1].meta_info.weight_versions[0].end == 1


def test_malformed_response_fails(stock_sglang):
    with pytest.raises(AssertionError, match="/generate response"):
        stock_sglang.check_response("/generate", {"text": "", "output_ids": "1"})
    info = stock_sglang.check_response("/model_info", {"model_path": "m", "weight_version": "4"})
    assert info.weight_version == "4"


def test_server_flags_follow_the_field_convention(stock_sglang):
    flags = stock_sglang.server_flags()
    assert {"--model-path", "--tp-size", "--tensor-parallel-size", "--base-gpu-id",
            "--weight-version", "--enable-deterministic-inference",
            "--skip-tokenizer-init"} <= flags
    assert "--bogus-flag" not in flags
    assert stock_sglang.server_flag("--skip-tokenizer-init").arity == "none"
    assert "dummy" in stock_sglang.server_flag("--load-format").choices
    with pytest.raises(AssertionError, match="--skip-tokenizer-init is a switch"):
        stock_sglang.check_server_argv(["--model-path", "m", "--skip-tokenizer-init=true"])
    with pytest.raises(AssertionError, match="unknown flag --bogus-flag"):
        stock_sglang.check_server_argv(["--model-path", "m", "--bogus-flag", "1"])
    with pytest.raises(AssertionError, match="--dtype 'fp64' is not one of"):
        stock_sglang.check_server_argv(["--model-path", "m", "--dtype", "fp64"])


def test_gpu_extra_pins_the_checked_release_and_its_torch(stock_sglang):
    """setup.py's `gpu` extra installs the release these tests check, with the torch it pins."""
    gpu = _gpu_extra(ROOT / "setup.py")
    assert f"sglang=={SGLANG_VERSION}" in gpu
    torch_pin = stock_sglang.pinned("torch")
    assert torch_pin, stock_sglang.requires_dist
    assert f"torch=={torch_pin}" in gpu, (gpu, torch_pin)


def _gpu_extra(setup_py: Path) -> list[str]:
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
            return [req.replace(" ", "") for req in extras["gpu"]]
    raise AssertionError("setup.py has no extras_require")
