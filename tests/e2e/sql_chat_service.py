"""A chat-completions server that answers with SQL chosen by the test, for the SQL adapter's end-to-end
tests (not part of the product).

The OpenAI API simulator answers with random text; a SQL route needs an answer that is SQL, and each
test needs a particular one (a good query, a DELETE, a timeout). So:
- `POST /answers` `{"question": "...", "content": "..."}`: the answer to give to that question (the
  last user message of a chat request); an unknown question gets `SELECT 1`;
- `POST /v1/chat/completions`: `choices[0].message.content` = that answer, usage prompt tokens =
  characters // 4 + 1, completion tokens = 9;
- `GET /last`: the last chat request received (what the gateway sent the model).
Run: `python tests/e2e/sql_chat_service.py PORT`.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, doc) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path == "/last":
            self._send(200, self.server.last)
        elif self.path in ("/health", "/v1/models"):
            self._send(200, {"object": "list", "data": []})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/answers":
            self.server.answers[req["question"]] = req["content"]
            self._send(200, {"ok": True})
            return
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        self.server.last = req
        messages = req.get("messages") or []
        question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
        content = self.server.answers.get(question, "SELECT 1")
        chars = sum(len(m.get("content") or "") for m in messages)
        self._send(200, {"id": "chatcmpl-sql1", "object": "chat.completion", "created": 1, "model": req.get("model"),
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": chars // 4 + 1, "completion_tokens": 9,
                                   "total_tokens": chars // 4 + 10}})


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.answers = {}  # question -> the answer's content (POST /answers)
    server.last = {}
    server.serve_forever()
