"""Stage `websocket-upgrade`: a websocket route's request must be a WebSocket upgrade (426 otherwise).

What: at request headers (the only phase a websocket route sends the processor), a request without
`Upgrade: websocket` (HTTP/1.1 `Connection: Upgrade` + `Upgrade: websocket`; an HTTP/2 or HTTP/3
extended CONNECT reaches us as the same headers, Envoy converts it) is refused with 426
`websocket_upgrade_required` naming the route, unless the route sets `websocket.requireUpgrade: false`
(then it goes to the backend as plain HTTP). It runs after `admit` (401/403 first) and before
`token-budget` (a refused request costs no budget).
Why: Envoy forwards a plain request on an upgrade-enabled route as ordinary HTTP; the backend's
own answer to that (a 426 or 400 from whatever WebSocket server it is) is less clear than ours.
Cost: two header lookups.
"""

from __future__ import annotations

from extproc.errors import reject
from extproc.types import HttpMessage, RequestState, Verdict


def is_upgrade(headers: dict[str, str] | None) -> bool:
    """True when the request asks for a WebSocket upgrade (`Upgrade: websocket`, any case)."""
    h = headers or {}
    return "websocket" in (t.strip().lower() for t in h.get("upgrade", "").split(","))


class WebSocketUpgrade:
    name = "websocket-upgrade"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        ws = state.route.websocket
        if (ws is not None and not ws.require_upgrade) or is_upgrade(msg.headers):
            return None
        return reject(426, "websocket_upgrade_required",
                      f"route {state.route.name} serves WebSocket connections only: send a WebSocket upgrade "
                      "(Connection: Upgrade, Upgrade: websocket)")
