"""``vllm.endpoint_plugins`` entry point (opt-in: ``VLLM_PLUGINS=pte``): the ``/pte/*``
HTTP routes and the middleware that tags generation requests with their session, tenant,
adapter and trace. ``SessionMiddleware`` is also what ``--middleware`` takes, for a server
that wants the tags without the routes."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from pte_instrument.server.api_server import ApiServer, api_server
from pte_instrument.vllm_adapter import compat


def _api_keys_of(app: Any) -> list[str]:
    return compat.api_keys(compat.app_args(app))


class SessionMiddleware:
    """The tagging middleware of this process's plugin, reading vLLM's API keys and LoRA
    adapters from the app (vLLM's ``--middleware`` builds it as ``SessionMiddleware(app)``)."""

    def __init__(self, app: ASGIApp, server: ApiServer | None = None) -> None:
        self.app = (server or api_server()).middleware(app, _api_keys_of, compat.served_lora_adapters)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class PteEndpoints:
    """The ``EndpointPlugin`` vLLM instantiates from the entry point."""

    name = "pte"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        server = api_server()
        app.include_router(server.router())
        app.add_middleware(SessionMiddleware, server=server)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        api_server().set_api_keys(compat.api_keys(args))
