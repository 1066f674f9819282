"""Stack `aio-generic`: grpc.aio with a generic handler, raw bytes in, prebuilt bytes out.

`grpc.method_handlers_generic_handler` with a `stream_stream_rpc_method_handler` that has neither a
request deserializer nor a response serializer: the handler gets each ProcessingRequest as the bytes
off the wire, reads only the field number of its `request` oneof (common.phase_field: the first tag,
no protobuf parse) and yields the phase's prebuilt serialized reply (common.REPLY_BY_FIELD). Same
server options and event loop as `aio` (the gateway's options, the stdlib loop), so the difference to
`aio` is the parse and serialize per message. Registered as a generic handler only (the generated
`add_ExternalProcessorServicer_to_server` also calls `add_registered_method_handlers`, grpcio's
per-method fast path): as measured in perf/RESULTS.md 2026-12-01; perf/stacks.md says what a port
into the gateway would register.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from aio_generated import serve_aio, server_options  # noqa: E402

import grpc  # noqa: E402


async def process(request_iterator, context):
    phase_field, replies = common.phase_field, common.REPLY_BY_FIELD
    async for data in request_iterator:
        field = phase_field(data)
        if field is not None:
            yield replies[field]


def add(server) -> None:
    handler = grpc.stream_stream_rpc_method_handler(process, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(common.SERVICE, {"Process": handler}),))


def main() -> None:
    args = common.parse_args(__doc__)
    asyncio.run(serve_aio(args.port, args.host, add, server_options()))


if __name__ == "__main__":
    main()
