"""Bounded JSON parsing and typed field reads of request bodies (megarl.rollout.wire)."""
import pytest

from megarl.rollout.protocol import BadRequest
from megarl.rollout.wire import MAX_DEPTH, Fields, parse_object


def refused(raw: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        parse_object(raw)
    return e.value


def test_limits_name_the_field_and_the_place():
    e = refused(b'{"sampling_params": {"top_k": ' + b"9" * 5000 + b"}}")
    assert e.field == "sampling_params.top_k" and "5000 characters" in str(e)
    e = refused(b'{"input_ids": [[1, 2], [3, ' + b"1" * 21 + b"]]}")
    assert e.field == "input_ids" and "input_ids[1][1]" in str(e)
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    e = refused(b'{"shapes": ' + deep + b"}")
    assert e.field == "shapes" and "nested deeper" in str(e)
    # Past the C parser's recursion nothing can say where: the body is named.
    assert refused(b"[" * 100_000 + b"]" * 100_000).field == "body"


def test_within_limits_parses_as_json_does():
    ok = b'{"a": [[1, -2]], "b": {"c": 18446744073709551615}, "d": NaN, "e": 1e308}'
    body = parse_object(ok)
    assert body["a"] == [[1, -2]] and body["b"]["c"] == 2**64 - 1 and body["e"] == 1e308
    assert parse_object(b"") == {} and parse_object(b" \n") == {}
    nested = b'{"x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert parse_object(nested)["x"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1]", b"null", b'{"a": "\xff"}', b"\x00"])
def test_not_an_object_is_the_body(raw):
    assert refused(raw).field == "body"


def test_fields_refuse_wrong_types_and_ranges_by_name():
    f = Fields({"port": 70000, "flag": 1, "name": "", "names": ["a", 2], "n": None},
               prefix="p.")
    for read, field in [(lambda: f.get_int("port", lo=1, hi=65535), "p.port"),
                        (lambda: f.get_bool("flag"), "p.flag"),
                        (lambda: f.get_str("name", nonempty=True), "p.name"),
                        (lambda: f.get_str_list("names"), "p.names"),
                        (lambda: f.get_int("n", required=True), "p.n"),
                        (lambda: f.get_str("missing", required=True), "p.missing")]:
        with pytest.raises(BadRequest) as e:
            read()
        assert e.value.field == field
    assert f.get_int("n", 7) == 7 and f.get_str("absent", "d") == "d"  # null: the default
