import json

from extproc.traffic.chat import (
    Answer,
    header_int,
    prompt_estimate,
    read_json_answer,
    read_sse_line,
    request_body,
    request_headers,
    timing_fields,
)

# Lines as llama.cpp's server streams them (abridged from a real xllamacpp answer).
SSE = [
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]}',
    b"",
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"I"}}]}',
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\'m"}}]}',
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
    b'"timings":{"cache_n":36,"prompt_n":1,"prompt_ms":49.8,"predicted_n":5,"predicted_ms":169.9}}',
    b"data: [DONE]",
]


def test_stream_gives_text_timings_and_one_first_token():
    answer = Answer()
    firsts = [read_sse_line(line, answer) for line in SSE]
    assert firsts == [False, False, True, False, False, False]
    assert answer.content == "I'm"
    assert timing_fields(answer.timings) == {
        "cache_n": 36, "prompt_n": 1, "prompt_ms": 49.8, "predicted_n": 5, "predicted_ms": 169.9
    }  # fmt: skip


def test_json_answer():
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hi"}}], "timings": {"cache_n": 3}})
    answer = read_json_answer(body.encode())
    assert answer.content == "Hi" and timing_fields(answer.timings)["cache_n"] == 3
    assert timing_fields(answer.timings)["prompt_n"] is None


def test_request_resends_history_with_fixed_answer_length():
    messages = [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 9}]
    body = request_body(messages, max_tokens=8, stream=True, model="m")
    assert body["messages"] == messages and body["ignore_eos"] is True and body["max_tokens"] == 8
    assert request_headers("s1-c00003", 2)["x-turn"] == "2"
    assert prompt_estimate(messages, 4.0) == 13  # ceil(49 / 4)


def test_header_int_tolerates_missing_and_junk():
    assert header_int({"x": "12"}, "x") == 12
    assert header_int({}, "x") is None and header_int({"x": "n/a"}, "x") is None
