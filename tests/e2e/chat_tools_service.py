"""A chat-completions server that calls tools, for the client-API end-to-end tests (not part of the product).

The OpenAI API simulator (backends/simulator_openai.py) answers with text only; this server answers
`POST /v1/chat/completions` the way vLLM does with tool calling on, so the tool-use translations can
be checked through Envoy with the official clients:
- a request with `tools` and `tool_choice` "required" or a named function: one tool call to that
  tool (the first one for "required"), its arguments built from the tool's `parameters` (each
  required property: strings "Oslo", integers 3, numbers 1.5, booleans true), `finish_reason`
  "tool_calls";
- a last user message with a line `CALL <name> <JSON arguments>`: that tool call as written,
  whether or not the tool was offered (so a gateway's checks of the model's choice can be tested);
- otherwise a text answer: `result: <content of the last tool message>` after a tool result, else
  `echo: <last user text>`;
- `stream: true`: vLLM's chunk layout (role chunk, the tool call's id and name, then its arguments
  in two pieces, the finish chunk, a usage chunk with `stream_options.include_usage`, `[DONE]`);
- usage: prompt tokens = characters of all message contents // 4 + 1, completion tokens = 7;
- `GET /requests` returns the chat request bodies it received, in order (what the gateway sent; a
  gateway that probes its backends at start-up adds its probes there too).
Run: `python tests/e2e/chat_tools_service.py PORT`.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VALUES = {"string": "Oslo", "integer": 3, "number": 1.5, "boolean": True}


def arguments(tool: dict) -> dict:
    params = tool.get("function", {}).get("parameters") or {}
    props = params.get("properties") or {}
    return {name: VALUES.get(props.get(name, {}).get("type"), "x") for name in params.get("required", ())}


def scripted(req: dict) -> dict | None:
    user = next((m for m in reversed(req.get("messages") or []) if m.get("role") == "user"), {})
    content = user.get("content") if isinstance(user.get("content"), str) else ""
    for line in content.splitlines():
        if line.startswith("CALL "):
            name, _, args = line[5:].partition(" ")
            return {"id": f"call_{name}_1", "type": "function",
                    "function": {"name": name, "arguments": args.strip() or "{}"}}
    return None


def answer(req: dict) -> tuple[str | None, dict | None]:
    tools = req.get("tools") or []
    choice = req.get("tool_choice")
    if tools and scripted(req) is not None:
        return None, scripted(req)
    if tools and (choice == "required" or isinstance(choice, dict)):
        name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return None, {"id": f"call_{name}_1", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments(tool))}}
    messages = req.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return f"result: {messages[-1].get('content')}", None
    user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
    content = user.get("content")
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content or ())
    return f"echo: {text}", None


def prompt_tokens(req: dict) -> int:
    chars = 0
    for m in req.get("messages") or ():
        c = m.get("content")
        chars += len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c or ())
    return chars // 4 + 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path == "/requests":
            self._send(200, json.dumps(self.server.requests).encode())
        elif self.path in ("/health", "/v1/models"):
            self._send(200, b'{"object": "list", "data": []}')
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        self.server.requests.append(req)
        if self.path != "/v1/chat/completions":
            self._send(404, b'{"error": {"message": "not found"}}')
            return
        text, call = answer(req)
        usage = {"prompt_tokens": prompt_tokens(req), "completion_tokens": 7,
                 "total_tokens": prompt_tokens(req) + 7}
        finish = "tool_calls" if call else "stop"
        base = {"id": "chatcmpl-tools1", "created": 1, "model": req.get("model")}
        if not req.get("stream"):
            message = {"role": "assistant", "content": text}
            if call:
                message["tool_calls"] = [call]
            self._send(200, json.dumps({**base, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "finish_reason": finish}]}).encode())
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(delta=None, finish_reason=None, **extra):
            doc = {**base, "object": "chat.completion.chunk",
                   "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                   **extra}
            self._chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")

        event({"role": "assistant", "content": ""})
        if call:
            event({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}}]})
            args = call["function"]["arguments"]
            for piece in (args[: len(args) // 2], args[len(args) // 2:]):
                event({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        else:
            for i in range(0, len(text), 5):
                event({"content": text[i:i + 5]})
        event({}, finish)
        if (req.get("stream_options") or {}).get("include_usage"):
            event(None, usage=usage)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.requests = []  # the chat requests received (GET /requests)
    server.serve_forever()
