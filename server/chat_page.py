"""The chat page at `/`: static files shipped in the package (server/static), no CDN, no network.

The page streams /v1/chat/completions, with a system prompt, sampling settings, a stop button (it
aborts the fetch; the server aborts the request) and tokens/s; when /v1/models answers 401 it asks
for the API key. `ServerConfig.enable_chat_page=False` (`--disable-chat-page`) leaves it out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
          "/static/chat.css": ("chat.css", "text/css; charset=utf-8")}


def add_chat_page(app: FastAPI) -> None:
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _serve(STATIC / name, media_type), methods=["GET"], include_in_schema=False)


def _serve(file: Path, media_type: str):
    async def serve():
        return FileResponse(file, media_type=media_type, headers={"Cache-Control": "no-cache"})
    return serve
