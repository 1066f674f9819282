"""Client-facing API translations onto OpenAI chat-completion backends, one API per module.

The package imports nothing by itself; each module is one translation, pure functions and small
per-stream objects over parsed JSON (no I/O, no Envoy types), used by the `client-api` stage
(`extproc/stages/client_api.py`) on routes of kind `anthropic-messages` and `openai-responses`:

* `common`              what both need: `TranslationError` (a 4xx in the client's dialect), the request
                        checks both make, SSE framing, tool-argument parsing, the walk over a chat
                        response and over a chat stream (`ChatStream`, whose subclasses emit the events).
* `anthropic_messages`  the Anthropic Messages API (`POST /v1/messages`): request -> chat request,
                        chat response -> Message, chat chunks -> Messages stream events.
* `openai_responses`    the OpenAI Responses API (`POST /v1/responses`): request -> chat request,
                        chat response -> Response, chat chunks -> Responses stream events.

See docs/client-apis.md for the mapping tables and what is not translated.
"""
