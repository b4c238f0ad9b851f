"""Which headers cross the sidecar: hop-by-hop ones stop here."""

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.proxy import _REQUEST_DROP, _RESPONSE_DROP, forward_headers


@pytest.mark.parametrize(
    "headers, drop, kept",
    [
        (
            [
                ("Content-Type", "application/json"),
                ("Connection", "keep-alive"),
                ("Keep-Alive", "timeout=5"),
                ("Host", "sidecar:1"),
                ("Content-Length", "10"),
                ("x-request-id", "r1"),
                ("TE", "trailers"),
            ],
            _REQUEST_DROP,
            [("Content-Type", "application/json"), ("x-request-id", "r1")],
        ),
        # headers named by Connection are hop-by-hop too (RFC 9110 7.6.1), by any of its lines
        ([("Connection", "close, X-Hop"), ("X-Hop", "1"), ("X-End", "2")], _REQUEST_DROP, [("X-End", "2")]),
        (
            [("Connection", "keep-alive"), ("X-Hop", "1"), ("Connection", "X-Hop"), ("X-End", "2")],
            _REQUEST_DROP,
            [("X-End", "2")],
        ),
        (
            [("Connection", "keep-alive"), ("Connection", " x-hop ,"), ("X-Hop", "1"), ("X-End", "2")],
            _RESPONSE_DROP,
            [("X-End", "2")],
        ),
        # aiohttp's server has decoded the body the worker gets: its coding no longer applies
        (
            [("Content-Encoding", "gzip"), ("Content-Type", "application/json")],
            _REQUEST_DROP,
            [("Content-Type", "application/json")],
        ),
        # responses keep Content-Encoding (bytes pass through untouched) and repeated headers
        (
            [
                ("Content-Encoding", "gzip"),
                ("Transfer-Encoding", "chunked"),
                ("Set-Cookie", "a=1"),
                ("Set-Cookie", "b=2"),
                ("Content-Length", "3"),
            ],
            _RESPONSE_DROP,
            [("Content-Encoding", "gzip"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")],
        ),
    ],
)
def test_forward_headers(headers, drop, kept):
    out = forward_headers(CIMultiDictProxy(CIMultiDict(headers)), drop)
    assert list(out.items()) == kept
