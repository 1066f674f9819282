"""Stack `grpclib`: grpclib (pure-Python HTTP/2 on asyncio, the h2 package), protobuf messages.

The handler mapping is what grpclib's protoc plugin (`protoc --grpclib_python_out`) generates for
ExternalProcessor (`__mapping__` -> `grpclib.const.Handler(func, STREAM_STREAM, ProcessingRequest,
ProcessingResponse)`), written by hand here over the xds-protos messages the gateway uses, so no
generated file is needed; grpclib's ProtoCodec parses each request and serializes each reply as in
`aio`. Health: grpc.health.v1.Health/Check answered SERVING for any service from prebuilt bytes (the
codec passes `bytes` types through). Event loop: the stdlib's (`--loop uvloop` for uvloop); here
the loop does all the I/O, unlike grpc.aio, whose I/O is gRPC core's.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from grpclib.const import Cardinality, Handler  # noqa: E402
from grpclib.encoding.proto import ProtoCodec  # noqa: E402
from grpclib.server import Server, Stream  # noqa: E402

pb = common.pb


class Codec(ProtoCodec):
    """ProtoCodec, but a method whose types are `bytes` gets and returns the raw bytes."""

    def encode(self, message, message_type):
        return message if message_type is bytes else super().encode(message, message_type)

    def decode(self, data, message_type):
        return data if message_type is bytes else super().decode(data, message_type)


class ExternalProcessor:
    async def Process(self, stream: Stream) -> None:
        replies = common.REPLIES
        async for req in stream:
            phase = req.WhichOneof("request")
            if phase is not None:
                await stream.send_message(replies[phase])

    def __mapping__(self):
        return {common.METHOD: Handler(self.Process, Cardinality.STREAM_STREAM,
                                       pb.ProcessingRequest, pb.ProcessingResponse)}


class Health:
    async def Check(self, stream: Stream) -> None:
        await stream.recv_message()
        await stream.send_message(common.HEALTH_SERVING)

    def __mapping__(self):
        return {common.HEALTH_METHOD: Handler(self.Check, Cardinality.UNARY_UNARY, bytes, bytes)}


async def serve(ports: list[int], host: str) -> None:
    servers = []
    for p in ports:  # one Server per port (grpclib's start() binds one host:port)
        s = Server([ExternalProcessor(), Health()], codec=Codec())
        await s.start(host, p)
        servers.append(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    common.ready()
    await stop.wait()
    for s in servers:
        s.close()
        await s.wait_closed()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = ap.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(serve(args.port, args.host))


if __name__ == "__main__":
    main()
