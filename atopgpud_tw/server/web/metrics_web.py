"""The metrics listener's other pages: ``/``, ``/-/healthy`` (also ``/healthz``) and ``/-/ready``.

``/-/healthy`` answers 200 whenever the reactor answers at all.  ``/-/ready``
answers 200 once the first poll is folded in, while the latest poll worked, the
reader waits for nothing and a GPU was read in one of the last few polls;
otherwise 503 with the reason on one line (for a load balancer or ``kubectl
describe``).  They read a few attributes of the poller and are served behind the
same bounds and gate as ``/metrics``; any other path is `twisted.web.pages`' 404.
"""

from __future__ import annotations

from typing import Protocol

from twisted.web import pages
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request

_PLAIN = b"text/plain; charset=utf-8"


class PollState(Protocol):
    """What readiness reads of the poller (`PollerService` has it).

    ``failing`` (the cause the latest poll failed with), ``waiting`` (what the
    reader waits for, such as the NVIDIA driver) and ``unread`` (why no GPU was
    read in the last few polls) are read when present, None otherwise."""

    polls: int


def not_ready(poller: PollState) -> str | None:
    """Why the daemon is not ready to be scraped, in a few words; None when it is."""
    failing: str | None = getattr(poller, "failing", None)
    if failing is not None:
        return f"the reader is failing: {failing}"
    waiting: str | None = getattr(poller, "waiting", None)
    if waiting is not None:
        return waiting
    if poller.polls == 0:
        return "waiting for the first poll"
    unread: str | None = getattr(poller, "unread", None)
    return unread


def plain(request: Request, text: str) -> bytes:
    request.setHeader(b"content-type", _PLAIN)
    request.setHeader(b"cache-control", b"no-store")
    return text.encode("utf-8", "replace")


class Healthy(Resource):
    """``GET /-/healthy``: 200 while the process serves."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return plain(request, "atopgpud is healthy\n")


class Ready(Resource):
    """``GET /-/ready``: 200 once the first poll is done and the reader is not failing, else 503 and why."""

    isLeaf = True

    def __init__(self, poller: PollState) -> None:
        super().__init__()
        self.poller = poller

    def render_GET(self, request: Request) -> bytes:
        reason = not_ready(self.poller)
        if reason is None:
            return plain(request, "atopgpud is ready\n")
        request.setResponseCode(503)
        return plain(request, f"atopgpud is not ready: {' '.join(reason.split())}\n")


_INDEX = b"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>atopgpud</title></head>
<body><h1>atopgpud</h1>
<ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="-/healthy">/-/healthy</a>: 200 while the daemon serves</li>
<li><a href="-/ready">/-/ready</a>: 200 once it has polled its GPUs, else 503 and why</li>
</ul>
</body></html>
"""


class Index(Resource):
    """``GET /``: a small page linking the others."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return _INDEX


class Folder(Resource):
    """A path with children: itself and any child it lacks are 404s."""

    def getChild(self, path: bytes, request: Request) -> IResource:
        return pages.notFound()

    def render(self, request: Request) -> bytes | int:
        return pages.notFound().render(request)  # type: ignore[no-any-return]


def make_root(metrics: IResource, poller: PollState) -> Resource:
    """The site's tree: ``/``, ``/metrics``, ``/-/healthy``, ``/healthz``, ``/-/ready``."""
    root = Folder()
    root.putChild(b"", Index())
    root.putChild(b"metrics", metrics)
    healthy = Healthy()
    dash = Folder()
    dash.putChild(b"healthy", healthy)
    dash.putChild(b"ready", Ready(poller))
    root.putChild(b"-", dash)
    root.putChild(b"healthz", healthy)
    return root
