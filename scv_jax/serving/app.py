"""``build_app``: the FastAPI application of ``scv-jax serve``, its endpoints ``routes.router``, its
``ServingContext`` on ``app.state``. Its lifespan starts and stops the engine loop; every error, also
FastAPI's own (404, 405), is OpenAI's error JSON.
"""

from __future__ import annotations

import contextlib
import functools
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from scv_jax.serving.context import ServingContext
from scv_jax.serving.protocol import ApiError
from scv_jax.serving.routes import router

__all__ = ["ServingContext", "build_app"]


def build_app(ctx: ServingContext) -> FastAPI:
    """The FastAPI application serving ``ctx`` (its lifespan starts and stops the engine loop)."""
    app = FastAPI(title="scv-jax", lifespan=functools.partial(lifespan, ctx))
    app.state.serving = ctx
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def lifespan(ctx: ServingContext, app: FastAPI) -> AsyncIterator[None]:
    """Starts ``ctx``'s engine loop with the app; stops it (30 s at most) when the app stops."""
    ctx.engine_loop.start()
    yield
    ctx.engine_loop.stop(timeout=30)


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    """An ``ApiError``: OpenAI's error JSON with its status."""
    return JSONResponse(error.body(), status_code=error.status)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own errors (404, 405, ...) as OpenAI's error JSON, with their headers."""
    return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                        headers=error.headers)


async def server_error(request: Request, error: Exception) -> JSONResponse:
    """A bug: OpenAI's 500 (Starlette then logs the traceback)."""
    return JSONResponse(ApiError(500, f"internal server error: {type(error).__name__}").body(), status_code=500)
