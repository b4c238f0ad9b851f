"""What `sie` prints of the cluster and how it calls the admin API: text from node hosts and specs is
shown escaped (a node may speak only for itself, not for the operator's terminal), and the admin token
goes only to the address it was given (no redirect is followed)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from sie.cli import rollout_text
from sie.standalone import http_json
from sie.status_table import instance_rows, printable, render

HOSTILE = "crash\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[32mall good\x1b[0m\u202e\nforged row"


def test_printable_escapes_what_a_terminal_would_act_on_and_keeps_the_rest():
    assert printable("plain text, ünïcode and 中文") == "plain text, ünïcode and 中文"
    shown = printable(HOSTILE)
    assert shown.isprintable() and "\x1b" not in shown and "\n" not in shown
    assert "\\x1b[2J" in shown and "\\x07" in shown and "\\u202e" in shown and "\\n" in shown


def test_a_nodes_detail_reaches_the_status_table_escaped():
    status = {
        "models": [
            {
                "model_id": "chat",
                "instances": [
                    {"instance_id": "chat-0", "state": "failed", "node": "n1", "detail": HOSTILE, "cpus": HOSTILE}
                ],
            }
        ]
    }
    table = render(instance_rows(status))
    assert "\x1b" not in table and "\x07" not in table and "\u202e" not in table
    assert len(table.splitlines()) == 2, "one header and one row: a newline in a cell forges no row"


def test_a_rollouts_reason_is_printed_escaped():
    text = rollout_text({"model": "chat", "phase": "progressing", "reason": HOSTILE, "gates": [{"name": HOSTILE}]})
    assert "\x1b" not in text and "\x07" not in text
    assert all(line.startswith(("chat:", "  ")) for line in text.splitlines()), text


class _Redirecting(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/v1/status":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            body = b'{"stolen": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def redirecting() -> Iterator[str]:
    _Redirecting.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_admin_client_does_not_follow_a_redirect_with_the_token(redirecting):
    code, _ = http_json(f"{redirecting}/v1/status", token="ADMIN-SECRET")
    assert code == 302, "a redirect is an answer, shown as one"
    assert _Redirecting.seen == [("/v1/status", "Bearer ADMIN-SECRET")], "nothing went to /elsewhere"
