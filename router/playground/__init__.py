"""The browser playground at GET /playground: plain HTML, JS and CSS shipped in this package (no build step).

In: nothing but the files beside this module. Out: `router`, an APIRouter serving
the page and its two assets. The page is open even when API keys are on (it asks
for a key and sends it as a Bearer token to /v1 and /v2, which check it); it
talks to the router's own API only and fetches nothing from elsewhere.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

_FILES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def _file(name: str) -> Response:
    # The page is small and changes with the router version: browsers revalidate it every time.
    return Response(_read(name), media_type=_FILES[name], headers={"Cache-Control": "no-cache"})


@router.get("/playground")
async def page() -> Response:
    return _file("index.html")


@router.get("/playground/{name}")
async def asset(name: str) -> Response:
    if name not in _FILES:
        return Response("not found", status_code=404, media_type="text/plain")
    return _file(name)
