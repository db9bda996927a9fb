"""The WritingBench judge client against a stub OpenAI-compatible server on 127.0.0.1, and its score parser."""
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evaluation import writingbench
from evaluation.writingbench import JudgeClient, JudgeError, evaluate, parse_score, summary

CRITERIA = [{"name": f"C{i}", "criteria_description": f"criterion {i}", "1-2": "bad", "9-10": "great"}
            for i in range(3)]


def completion(content) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


def answer(body: bytes, status: int = 200, length: int | None = None):
    """A stub answer: `body` under `status`, declaring `length` bytes (default: the true length)."""
    def send(handler):
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body) if length is None else length))
        handler.end_headers()
        handler.wfile.write(body)
    return send


def judged(content) -> list:
    return [answer(completion(content))]


def raw(data: bytes):
    """A stub answer that writes `data` as the whole HTTP response, status line included."""
    return lambda handler: handler.wfile.write(data)


def trickle(from_byte: int):
    """Sends a valid response a byte every 50 ms from `from_byte` on, for at most 10 s."""
    data = b"HTTP/1.0 200 OK\r\nContent-Length: 4000\r\n\r\n" + b" " * 4000

    def send(handler):
        handler.wfile.write(data[:from_byte])
        stop = time.monotonic() + 10
        try:
            for i in range(from_byte, len(data)):
                if time.monotonic() > stop:
                    return
                handler.wfile.write(data[i:i + 1])
                time.sleep(0.05)
        except OSError:  # the client hung up, as it should
            pass
    return send


class StubJudge(BaseHTTPRequestHandler):
    """Serves a queue of answers (default: score 7) and records every request."""
    answers: list = []
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        send = type(self).answers.pop(0) if type(self).answers else answer(completion('{"score": 7}'))
        send(self)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    StubJudge.answers, StubJudge.requests = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", StubJudge
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def judge_pass(url, stub, answers, **client):
    """One pass over a sample with len(CRITERIA) criteria, the stub giving `answers` in turn."""
    stub.answers = list(answers)
    judge = JudgeClient(url, "stub-judge", **{"max_retries": 1, "retry_wait": 0.01, "timeout": 10, **client})
    return evaluate([{"index": 0, "query": "q", "checklist": CRITERIA}], lambda prompts: ["r"], judge)


def test_scores_every_criterion_and_averages(judge_server):
    url, stub = judge_server
    stub.answers = [*judged('{"score": 8, "reason": "good"}'), *judged('```json\n{"score": 6, "reason": "ok"}\n```'),
                    *judged('{"score": 3}'), *judged('{"score": 5}'), *judged('{"score": 4}'), *judged('{"score": 6}')]
    rows = [{"index": 1, "query": "Write a haiku about rain.", "checklist": CRITERIA},
            {"index": 2, "query": "Write a limerick.", "checklist": CRITERIA}]
    judge = JudgeClient(url, "stub-judge", api_key="secret", retry_wait=0.01)
    result = evaluate(rows, lambda prompts: [f"reply to: {p}" for p in prompts], judge)
    assert [s["score"] for s in result["samples"]] == [17 / 3, 5.0]
    assert result["score"] == pytest.approx((17 / 3 + 5) / 2)
    assert result["n_errors"] == 0 and result["n_judgements"] == 6
    assert summary(result) == f"WritingBench score = {result['score']:.2f} / 10 over 2 of 2 samples"
    assert len(stub.requests) == 6
    first = stub.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer secret"
    assert first["body"]["model"] == "stub-judge" and first["body"]["temperature"] == 0.0
    prompt = first["body"]["messages"][0]["content"]
    assert "Write a haiku about rain." in prompt and "reply to: Write a haiku" in prompt and "criterion 0" in prompt
    assert '{"score": <integer 1-10>, "reason":' in prompt


# Each bad answer, what it is served as (max_retries=1, so a retried one is served twice), and the error.
MALFORMED = [
    pytest.param([answer(b"", 500)] * 2, r"HTTP 500 .*gave up after 2 attempt", id="http-500-retried"),
    pytest.param([answer(b"", 401)], r"^HTTP 401 Unauthorized$", id="http-401-not-retried"),
    pytest.param([raw(b"garbage\r\n\r\n")], r"malformed HTTP response \(BadStatusLine: 'garbage\\r\\n'\)", id="not-http"),
    pytest.param([raw(b"")], r"malformed HTTP response \(RemoteDisconnected", id="closed-without-answer"),
    pytest.param([answer(completion("é")[:-1] + b"\xff")], r"not valid UTF-8 \(byte 0xff at offset", id="invalid-utf8"),
    pytest.param([answer(completion('{"score": 7}')[:40], length=400)], r"truncated body \(40 of 400 bytes\)",
                 id="truncated-body"),
    pytest.param([answer(b"")], r"body is empty", id="empty-body"),
    pytest.param([answer(b"<html>Bad gateway</html>")], r"body is not JSON \(Expecting value at char 0\)",
                 id="body-not-json"),
    pytest.param([answer(completion('{"score": 7}')[:-2])], r"body is not JSON", id="body-json-cut-short"),
    pytest.param([answer(b"[1, 2]")], r"body is a JSON array, not a chat completion", id="body-not-object"),
    pytest.param([answer(b'{"error": {"message": "model not loaded"}}')], r"judge answered an error: 'model not loaded'",
                 id="error-object"),
    pytest.param([answer(b'{"object": "chat.completion"}')], r"answer has no choices$", id="no-choices"),
    pytest.param([answer(b'{"choices": []}')], r"answer has no choices$", id="empty-choices"),
    pytest.param([answer(b'{"choices": [{"text": "{}"}]}')], r"no choices\[0\]\.message$", id="no-message"),
    pytest.param([answer(b'{"choices": [{"message": {"role": "assistant"}}]}')], r"message has no content$",
                 id="no-content"),
    pytest.param(judged(None), r"content is null, not a string", id="content-null"),
    pytest.param(judged(7), r"content is a JSON number, not a string", id="content-int"),
    pytest.param(judged({"score": 7}), r"content is a JSON object, not a string", id="content-object"),
    pytest.param(judged("I refuse to grade this."), r"not a JSON object: 'I refuse", id="content-prose"),
    pytest.param(judged('{"rating": 7, "reason": "a 7"}'), r'no "score" field', id="no-score-field"),
    pytest.param(judged('{"score": true}'), r"score true is a JSON boolean, not an integer", id="score-bool"),
    pytest.param(judged('{"score": 42}'), r"score 42 is outside 1-10", id="score-out-of-range"),
    pytest.param(judged('{"score": 3} {"score": 9}'), r"more than one JSON value", id="two-objects"),
]


@pytest.mark.parametrize("bad, error", MALFORMED)
def test_each_malformed_answer_is_one_clear_error_and_the_pass_goes_on(judge_server, bad, error):
    url, stub = judge_server
    result = judge_pass(url, stub, [*judged('{"score": 8}'), *bad, *judged('{"score": 6}')])
    sample = result["samples"][0]
    assert sample["criteria"] == {"C0": 8, "C2": 6} and sample["score"] == 7.0
    assert [e["criterion"] for e in sample["errors"]] == ["C1"]
    assert re.search(error, sample["errors"][0]["error"]), sample["errors"][0]
    assert result["score"] == 7.0 and result["n_errors"] == 1 and result["n_judgements"] == 3
    assert summary(result).endswith("; 1 of 3 judgements failed and are left out of the mean "
                                    "(each sample's \"errors\" in the JSON says why)")


def test_one_pass_survives_every_malformed_answer_in_turn(judge_server):
    url, stub = judge_server
    stub.answers = [send for case in MALFORMED for send in case.values[0]]
    checklist = [{**CRITERIA[0], "name": case.id} for case in MALFORMED]
    rows = [{"index": 0, "query": "q", "checklist": checklist}, {"index": 1, "query": "q", "checklist": CRITERIA}]
    result = evaluate(rows, lambda prompts: ["r", "r"], JudgeClient(url, "m", max_retries=1, retry_wait=0.01))
    bad, good = result["samples"]
    assert [e["criterion"] for e in bad["errors"]] == [case.id for case in MALFORMED] and bad["score"] is None
    assert good["errors"] == [] and good["score"] == 7.0
    assert (result["score"], result["n_scored"], result["n"]) == (7.0, 1, 2)
    assert result["n_errors"] == len(MALFORMED) and result["n_judgements"] == len(MALFORMED) + 3


def test_body_larger_than_the_cap_is_an_error(judge_server, monkeypatch):
    url, stub = judge_server
    monkeypatch.setattr(writingbench, "MAX_BODY_BYTES", 100)
    result = judge_pass(url, stub, [answer(completion('{"score": 7, "reason": "' + "x" * 200 + '"}'))])
    assert result["samples"][0]["errors"] == [{"criterion": "C0", "error": "body is larger than 100 bytes"}]


@pytest.mark.parametrize("from_byte", [0, 41], ids=["trickled-headers", "trickled-body"])
def test_a_trickling_server_is_cut_off_at_the_deadline(judge_server, from_byte):
    url, stub = judge_server
    start = time.monotonic()
    result = judge_pass(url, stub, [trickle(from_byte)], timeout=1.0)
    elapsed = time.monotonic() - start
    # Each byte resets a socket timeout, so without the deadline this runs until the stub stops at 10 s.
    assert elapsed < 2.5, elapsed
    sample = result["samples"][0]
    assert sample["errors"] == [{"criterion": "C0", "error": f"no complete answer from {url}/chat/completions within 1 s"}]
    assert sample["criteria"] == {"C1": 7, "C2": 7}


def test_retries_server_errors_a_bounded_number_of_times_within_the_deadline(judge_server):
    url, stub = judge_server
    stub.answers = [answer(b"", 503), *judged('{"score": 9}')]
    assert parse_score(JudgeClient(url, "m", retry_wait=0.01).chat([{"role": "user", "content": "x"}])) == 9
    assert len(stub.requests) == 2
    stub.answers, stub.requests[:] = [answer(b"", 500)] * 10, []
    with pytest.raises(JudgeError, match="HTTP 500 .*after 3 attempt"):
        JudgeClient(url, "m", max_retries=2, retry_wait=0.01).chat([{"role": "user", "content": "x"}])
    assert len(stub.requests) == 3
    # A back-off that would outlast the request's deadline is not waited out.
    stub.answers, stub.requests[:] = [answer(b"", 429)] * 10, []
    start = time.monotonic()
    with pytest.raises(JudgeError, match="HTTP 429 .*after 1 attempt"):
        JudgeClient(url, "m", timeout=2, retry_wait=30).chat([{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 2 and len(stub.requests) == 1


def test_unreachable_endpoint_fails_with_one_clear_error():
    with pytest.raises(JudgeError, match="cannot reach"):
        JudgeClient("http://127.0.0.1:9/v1", "m", timeout=2, max_retries=1, retry_wait=0.01).chat([])


@pytest.mark.parametrize("text, score", [
    ('{"score": 7, "reason": "clear"}', 7),
    ('  {"reason": "weak", "score": 1}\n', 1),
    ('```json\n{"score": 6, "reason": "ok"}\n```', 6),
    ('```\n{"score": 10}\n```', 10),
])
def test_score_parser_accepts_the_contract(text, score):
    assert parse_score(text) == score and type(parse_score(text)) is int


@pytest.mark.parametrize("text, error", [
    pytest.param('{"score": true}', "is a JSON boolean, not an integer", id="bool"),
    pytest.param('{"score": 7.5}', "is a JSON number, not an integer", id="float"),
    pytest.param('{"score": 7.0}', "is a JSON number, not an integer", id="integral-float"),
    pytest.param('{"score": "7"}', "is a JSON string, not an integer", id="string"),
    pytest.param('{"score": null}', "is a JSON null, not an integer", id="null"),
    pytest.param('{"score": 0}', "outside 1-10", id="zero"),
    pytest.param('{"score": 11}', "outside 1-10", id="eleven"),
    pytest.param('{"score": 3}\n{"score": 9}', "more than one JSON value", id="two-objects"),
    pytest.param('{"score": 3, "score": 9}', "gives 'score' more than once", id="duplicate-key"),
    pytest.param('{"reason": "I would give it 8 out of 10"}', 'no "score" field', id="digits-only-in-reason"),
    pytest.param("Score: 8", "not a JSON object", id="score-in-prose"),
    pytest.param('Here it is: {"score": 8}', "not a JSON object", id="prose-before"),
    pytest.param('{"score": 8} I hope this helps.', "text after its JSON object", id="prose-after"),
    pytest.param('[{"score": 8}]', "is a JSON array, not an object", id="array"),
    pytest.param('```json\n{"score": 3}\n```\n```json\n{"score": 9}\n```', "at most one fence", id="two-fences"),
    pytest.param("", "not a JSON object", id="empty"),
])
def test_score_parser_rejects_everything_else(text, error):
    with pytest.raises(JudgeError, match=error.replace("(", r"\(")):
        parse_score(text)
