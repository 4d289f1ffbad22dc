"""Request validation, n-expansion, SGLang wire round trip and continuation requests."""
import pytest

from megarl.rollout.protocol import (BadRequest, FinishReason, GenerateOutput, GenerateRequest,
                                     SamplingParams, continuation)


@pytest.mark.parametrize("params, field", [
    ({"max_new_tokens": 0}, "sampling_params.max_new_tokens"),
    ({"max_new_tokens": -3}, "sampling_params.max_new_tokens"),
    ({"max_new_tokens": 2.5}, "sampling_params.max_new_tokens"),
    ({"temperature": -0.1}, "sampling_params.temperature"),
    ({"temperature": float("nan")}, "sampling_params.temperature"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"top_k": 0}, "sampling_params.top_k"),
    ({"n": 0}, "sampling_params.n"),
    ({"stop_token_ids": [1, "x"]}, "sampling_params.stop_token_ids"),
    ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty"),
    ({"max_new_token": 8}, "sampling_params.max_new_token"),
])
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(BadRequest) as e:
        SamplingParams.from_dict(params)
    assert e.value.field == field and field in str(e.value)


def test_null_values_take_defaults():
    sp = SamplingParams.from_dict({"top_p": None, "max_new_tokens": 7})
    assert sp.top_p == 1.0 and sp.max_new_tokens == 7


@pytest.mark.parametrize("ids", [[], [1, -2], [1, True], "abc"])
def test_bad_input_ids(ids):
    with pytest.raises(BadRequest) as e:
        GenerateRequest(ids).validate(vocab_size=100)
    assert e.value.field == "input_ids"


def test_token_id_beyond_vocab():
    with pytest.raises(BadRequest, match="vocabulary"):
        GenerateRequest([5, 100]).validate(vocab_size=100)


def test_expand_gives_distinct_reproducible_seeds():
    req = GenerateRequest([1, 2], SamplingParams(n=3, sampling_seed=5), rid="r")
    a, b = req.expand(), req.expand()
    assert [r.rid for r in a] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.sampling_seed for r in a] == [r.sampling.sampling_seed for r in b]
    assert len({r.sampling.sampling_seed for r in a}) == 3
    assert all(r.sampling.n == 1 for r in a)


def test_sglang_round_trip():
    out = GenerateOutput("r", 3, [4, 5, 6], [-0.5, -1.0, -2.0], FinishReason("stop", matched=6),
                         "2", [("1", 0, 2), ("2", 2, 3)])
    back = GenerateOutput.from_sglang(out.to_sglang())
    assert back == out
    assert back.token_versions() == [1, 1, 2]  # megarl's integers
    wire = out.to_sglang()
    assert wire["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 2},
                                                    {"version": "2", "start": 2, "end": 3}]
    assert wire["meta_info"]["output_token_logprobs"][1] == [-1.0, 5, None]
    assert wire["meta_info"]["finish_reason"] == {"type": "stop", "matched": 6}


def test_from_real_sglang_response_without_spans():
    d = {"output_ids": [7, 8], "meta_info": {"id": "x", "prompt_tokens": 2,
         "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
         "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]]}}
    out = GenerateOutput.from_sglang(d)
    assert out.weight_version_spans == [("3", 0, 2)] and out.output_logprobs == [-0.1, -0.2]
    assert out.token_versions() == [3, 3]


def test_versions_that_megarl_did_not_set_are_refused_by_name():
    from megarl.rollout.protocol import version_int

    assert version_int("default") == 0 and version_int("12") == 12
    with pytest.raises(ValueError, match="weight_versions"):
        version_int("stale")


def test_continuation_resumes_with_remaining_budget():
    req = GenerateRequest([1, 2], SamplingParams(max_new_tokens=10, min_new_tokens=4), rid="r")
    partial = GenerateOutput("r", 2, [3, 4, 5], [-1.0] * 3, FinishReason("abort"), "0")
    nxt = continuation(req, partial.output_ids)
    assert nxt.input_ids == [1, 2, 3, 4, 5]
    assert nxt.sampling.max_new_tokens == 7 and nxt.sampling.min_new_tokens == 1
    assert nxt.rid != req.rid
