"""The WritingBench judge client against a stub OpenAI-compatible server on 127.0.0.1."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evaluation.writingbench import JudgeClient, JudgeError, evaluate, parse_score

CRITERIA = [{"name": f"C{i}", "criteria_description": f"criterion {i}", "1-2": "bad", "9-10": "great"}
            for i in range(2)]


class StubJudge(BaseHTTPRequestHandler):
    """Answers from a queue of (status, body) and records every request."""
    answers: list = []
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        status, content = type(self).answers.pop(0) if type(self).answers else (200, '{"score": 7}')
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    StubJudge.answers, StubJudge.requests = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", StubJudge
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_scores_every_criterion_and_averages(judge_server):
    url, stub = judge_server
    stub.answers = [(200, '{"score": 8, "reason": "good"}'), (200, '```json\n{"score": 6, "reason": "ok"}\n```'),
                    (200, '{"score": 3}'), (200, "Score: 5")]
    rows = [{"index": 1, "query": "Write a haiku about rain.", "checklist": CRITERIA},
            {"index": 2, "query": "Write a limerick.", "checklist": CRITERIA}]
    judge = JudgeClient(url, "stub-judge", api_key="secret", retry_wait=0.01)
    result = evaluate(rows, lambda prompts: [f"reply to: {p}" for p in prompts], judge)
    assert [s["score"] for s in result["samples"]] == [7.0, 4.0]
    assert result["score"] == pytest.approx(5.5)
    assert len(stub.requests) == 4
    first = stub.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer secret"
    assert first["body"]["model"] == "stub-judge" and first["body"]["temperature"] == 0.0
    prompt = first["body"]["messages"][0]["content"]
    assert "Write a haiku about rain." in prompt and "reply to: Write a haiku" in prompt and "criterion 0" in prompt


def test_retries_server_errors_a_bounded_number_of_times(judge_server):
    url, stub = judge_server
    stub.answers = [(503, ""), (200, '{"score": 9}')]
    assert parse_score(JudgeClient(url, "m", retry_wait=0.01).chat([{"role": "user", "content": "x"}])) == 9
    assert len(stub.requests) == 2
    stub.answers, stub.requests[:] = [(500, "")] * 10, []
    with pytest.raises(JudgeError, match="after 3 attempt"):
        JudgeClient(url, "m", max_retries=2, retry_wait=0.01).chat([{"role": "user", "content": "x"}])
    assert len(stub.requests) == 3


def test_client_errors_are_not_retried_and_bad_scores_are_recorded(judge_server):
    url, stub = judge_server
    stub.answers = [(401, "")]
    with pytest.raises(JudgeError, match="HTTP 401"):
        JudgeClient(url, "m", retry_wait=0.01).chat([{"role": "user", "content": "x"}])
    assert len(stub.requests) == 1
    stub.answers = [(200, "I refuse to grade."), (200, '{"score": 42}')]
    result = evaluate([{"query": "q", "checklist": CRITERIA}], lambda p: ["r"], JudgeClient(url, "m"))
    assert result["score"] is None and len(result["samples"][0]["errors"]) == 2


def test_unreachable_endpoint_fails_with_one_clear_error():
    with pytest.raises(JudgeError, match="cannot reach"):
        JudgeClient("http://127.0.0.1:9/v1", "m", timeout=2, max_retries=1, retry_wait=0.01).chat([])
