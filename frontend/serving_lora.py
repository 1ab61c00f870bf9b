"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with
--enable-runtime-lora-updating): vLLM's bodies and answers; the work is
lora_adapters.py's."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from frontend.config import FrontendConfig
from frontend.openai_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from frontend.request_inputs import parse_body
from frontend.serving import ServingContext


def runtime_lora_updating(config: FrontendConfig) -> bool:
    """The load and unload routes are served only with --enable-runtime-lora-updating."""
    return config.enable_runtime_lora_updating


async def load_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    ctx.preflight()
    body = await parse_body(ctx, request, LoadLoRAAdapterRequest)
    text = await ctx.loras.load(body.lora_name, body.lora_path, body.load_inplace)
    return Response(text, media_type="text/plain")


async def unload_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    ctx.preflight()
    body = await parse_body(ctx, request, UnloadLoRAAdapterRequest)
    return Response(await ctx.loras.unload(body.lora_name), media_type="text/plain")
