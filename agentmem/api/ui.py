"""The memory inspector page, served at `/ui`.

The page is plain static files (no build step, nothing fetched from a CDN); it reads the
tenant's data through the same JSON endpoints and API key as any client, so serving the
files themselves needs no key: without one the page shows nothing but a key field.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def mount_ui(app: FastAPI, path: str = "/ui") -> None:
    """Serve the inspector at `path` (with and without the trailing slash)."""
    if not (STATIC_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the inspector page is missing from {STATIC_DIR}")

    @app.api_route(path, methods=["GET", "HEAD"], include_in_schema=False)
    def _ui_root() -> RedirectResponse:
        return RedirectResponse(f"{path}/")

    app.mount(path, StaticFiles(directory=STATIC_DIR, html=True), name="ui")
