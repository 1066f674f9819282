"""Bulk TCP sender/sink for the RTT test: `python bulk_tcp.py HOST PORT SECONDS`.

Listens on HOST:PORT (a sink that reads and discards), connects to it and sends for SECONDS,
then exits. Run inside a network namespace the test creates (ip netns exec NS ...).
"""

import socket
import sys
import threading
import time


def main() -> int:
    host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    srv = socket.socket(fam, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)

    def sink():
        conn, _ = srv.accept()
        while conn.recv(1 << 16):
            pass
        conn.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    cli = socket.create_connection((host, port))
    chunk = b"x" * 65536
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        sent += cli.send(chunk)
    cli.close()
    t.join(5)
    srv.close()
    print(sent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
