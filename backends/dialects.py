"""Backend dialects: what one OpenAI-compatible server accepts, and how a request is encoded for it.

What: a `Dialect` says, per backend, how it takes structured output (`structured`), whether it sends
a usage chunk at the end of a stream (`stream_usage`), whether it loads LoRA adapters at run time
(`lora`) and what it does with a request `priority` (`priority`). The gateway learns it by probing
the backend (extproc/negotiate.py) and a config may fix any part (`spec.backends[].dialect`); the
adapters (backends/openai.py) encode requests with it. The structured-output encodings:

| `structured` | request fields | servers |
|---|---|---|
| `json_schema` | `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | OpenAI, vLLM >= 0.6, SGLang, Ollama's OpenAI API, llama.cpp's C++ server |
| `json_object_schema` | `response_format: {"type": "json_object", "schema": S}` | llama-cpp-python's server (and llama.cpp's) |
| `structured_outputs` | `structured_outputs: {"json": S}` | vLLM >= 0.10.2 |
| `guided_json` | `guided_json: S` | vLLM before 0.12 (deprecated there) |
| `sglang_json_schema` | `json_schema: "<S as a JSON string>"` | SGLang's native sampling parameter, also read on its OpenAI API |
| `ollama_format` | `format: S` | Ollama's native chat API |
| `prompt` | none: the schema goes in the system prompt; the answer is validated, with one repair retry | a server that constrains nothing |

Presets name the usual combination per server (`PRESETS`). `stream_usage` is "yes" (a final chunk
with `usage` after `stream_options.include_usage`), "no" (the option is accepted but no usage comes:
the gateway estimates and says so), or "refused" (the option makes the server fail: not sent).
`priority` is "honoured" (vLLM with `--scheduling-policy priority`, SGLang), "ignored" (accepted and
dropped) or "refused" (the field makes the server fail: removed before sending). `lora` is
"runtime" (vLLM's `/v1/load_lora_adapter`) or "none".
Why: the servers speak one API in several dialects; sending the wrong one is a 400 or 500 from the
server (llama.cpp refuses `json_schema`), or, worse, an unconstrained answer.
Cost: a few dict operations per request.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Mapping

import orjson

STRUCTURED = ("json_schema", "json_object_schema", "structured_outputs", "guided_json", "sglang_json_schema",
              "ollama_format", "prompt")
STREAM_USAGE = ("yes", "no", "refused")
PRIORITY = ("honoured", "ignored", "refused")
LORA = ("runtime", "none")
# the order the probe tries structured-output encodings in (the first the server enforces wins)
PROBE_ORDER = ("json_schema", "json_object_schema", "structured_outputs", "guided_json")

PROMPT_SCHEMA = ("Answer with a single JSON object that matches this JSON Schema, and nothing else (no prose, "
                 "no code fences):\n")
REPAIR = ("Your previous answer was not a JSON object matching the schema ({error}). Answer again with only "
          "the corrected JSON object.")


@dataclass(frozen=True, slots=True)
class Dialect:
    structured: str = "json_schema"
    stream_usage: str = "yes"
    priority: str = "ignored"
    lora: str = "none"
    engine: str = "openai"  # what the server said it is (or the preset's name)

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS: Mapping[str, Dialect] = MappingProxyType({
    "openai": Dialect(),
    "vllm": Dialect("json_schema", "yes", "honoured", "runtime", "vllm"),
    "llamacpp": Dialect("json_object_schema", "no", "ignored", "none", "llamacpp"),
    "sglang": Dialect("json_schema", "yes", "honoured", "none", "sglang"),
    "ollama": Dialect("json_schema", "yes", "ignored", "none", "ollama"),
})
# before (or without) negotiation, by backend kind
DEFAULT_PRESET: Mapping[str, str] = MappingProxyType({"openai": "openai", "vllm": "vllm"})


@dataclass(frozen=True, slots=True)
class DialectConfig:
    """`spec.backends[].dialect` compiled: a preset and fixed parts; `negotiate` false: no probing."""

    negotiate: bool = True
    preset: str | None = None
    structured: str | None = None
    stream_usage: str | None = None
    priority: str | None = None
    lora: str | None = None

    def base(self, kind: str) -> Dialect:
        """The dialect before negotiation: the preset (default by kind), with the fixed parts."""
        return self.apply(PRESETS[self.preset or DEFAULT_PRESET.get(kind, "openai")])

    def apply(self, dialect: Dialect) -> Dialect:
        """`dialect` (negotiated) with the parts the config fixes put over it."""
        fixed = {k: v for k in ("structured", "stream_usage", "priority", "lora")
                 if (v := getattr(self, k)) is not None}
        return replace(dialect, **fixed) if fixed else dialect

    def fixed(self) -> tuple[str, ...]:
        return tuple(k for k in ("structured", "stream_usage", "priority", "lora") if getattr(self, k) is not None)


def structured_fields(structured: str, name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields that ask `structured`'s server for output matching `schema` ({} for prompt)."""
    if structured == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": name, "schema": schema, "strict": True}}}
    if structured == "json_object_schema":
        return {"response_format": {"type": "json_object", "schema": schema}}
    if structured == "structured_outputs":
        return {"structured_outputs": {"json": schema}}
    if structured == "guided_json":
        return {"guided_json": schema}
    if structured == "sglang_json_schema":
        return {"json_schema": orjson.dumps(schema).decode()}
    if structured == "ollama_format":
        return {"format": schema}
    if structured == "prompt":
        return {}
    raise ValueError(f"unknown structured-output dialect {structured!r}")


def schema_prompt(schema: Mapping[str, Any]) -> str:
    """The system prompt of the `prompt` fallback: the schema itself, compact."""
    return PROMPT_SCHEMA + orjson.dumps(schema).decode()


def client_schema(body: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(name, schema) of an OpenAI client's `response_format: json_schema` (None for anything else)."""
    rf = body.get("response_format")
    if not isinstance(rf, dict) or rf.get("type") != "json_schema":
        return None
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        return None
    return str(js.get("name") or "response"), js["schema"]


def translate(body: dict[str, Any], dialect: Dialect) -> bool:
    """Rewrite an OpenAI client's request body in place for `dialect`; True when it changed.

    `response_format: json_schema` becomes the backend's structured-output fields (for `prompt`,
    the schema is prepended to the messages as a system message); a `priority` the server refuses
    is removed. Everything else passes untouched."""
    changed = False
    if dialect.priority == "refused" and "priority" in body:
        del body["priority"]
        changed = True
    asked = client_schema(body)
    if asked is None or dialect.structured == "json_schema":
        return changed
    name, schema = asked
    del body["response_format"]
    if dialect.structured == "prompt":
        messages = body.get("messages")
        if isinstance(messages, list):
            body["messages"] = [{"role": "system", "content": schema_prompt(schema)}, *messages]
    else:
        body.update(structured_fields(dialect.structured, name, schema))
    return True


def first_json_object(content: Any) -> Any:
    """The JSON object in a model's answer: the whole text, else the span from its first `{` to its
    last `}` (models asked in the prompt add prose or code fences). Raises ValueError when none."""
    if not isinstance(content, str):
        raise ValueError("the answer has no text")
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        pass
    start, end = content.find("{"), content.rfind("}")
    if start < 0 or end < start:
        raise ValueError("the answer holds no JSON object")
    try:
        return orjson.loads(content[start:end + 1])
    except orjson.JSONDecodeError as e:
        raise ValueError(f"the answer's JSON is malformed ({e})") from None


def schema_error(schema: Mapping[str, Any], doc: Any) -> str | None:
    """The first way `doc` breaks `schema` (path and reason), None when it matches."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(doc))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"[:300]


__all__ = ["Dialect", "DialectConfig", "PRESETS", "STRUCTURED", "STREAM_USAGE", "PRIORITY", "LORA", "PROBE_ORDER",
           "structured_fields", "schema_prompt", "client_schema", "translate", "first_json_object", "schema_error",
           "REPAIR"]
