"""The server's routes about what it serves: `GET /health` (no key), `GET /metrics`
(Prometheus; the key only with --protect-metrics), `GET /v1/models` and `/v1/models/{id}`,
LoRA adapters loaded and unloaded at run time (vLLM's `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) and `POST /update_weights` (a trainer's push)."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from lathe.core.errors import CheckpointError
from lathe.serve.protocol import LoraAdapterRequest, UpdateWeightsRequest
from lathe.serve.request_checks import AdapterError
from lathe.serve.serving import APIError, authorize, authorize_metrics, inside, serving

log = logging.getLogger("lathe.serve")

open_router = APIRouter()  # answered without the API key
router = APIRouter(dependencies=[Depends(authorize)])


@open_router.get("/health")
async def health(request: Request) -> Response:
    ctx = serving(request)
    if ctx.engine is None:
        if ctx.load_error is not None:
            return JSONResponse({"status": ctx.load_error}, status_code=503)
        return JSONResponse({"status": "loading", "detail": ctx.warming
                             or f"loading {ctx.config.checkpoint}"}, status_code=503)
    if ctx.engine.dead is not None:
        return JSONResponse({"status": str(ctx.engine.dead)}, status_code=503)
    return JSONResponse({"status": "ok"})


@open_router.get("/metrics", dependencies=[Depends(authorize_metrics)])
async def prometheus(request: Request) -> Response:
    return Response(serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = serving(request)
    engine = ctx.ready()
    created = int(time.time())
    return {"object": "list", "data": [{
        "id": ctx.name, "object": "model", "created": created, "owned_by": "lathe",
        "root": str(ctx.config.checkpoint), "parent": None,
        "max_model_len": engine.max_model_len}] + [{
            "id": adapter, "object": "model", "created": created, "owned_by": "lathe",
            "root": engine.adapter_path(adapter),
            "parent": ctx.name, "max_model_len": engine.max_model_len}
            for adapter in engine.adapter_names]}


@router.get("/v1/models/{model:path}")
async def model_card(model: str, request: Request) -> dict[str, Any]:
    serving(request).ready(model)
    return next(card for card in (await models(request))["data"] if card["id"] == model)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoraAdapterRequest, request: Request) -> Response:
    ctx = serving(request)
    config = ctx.config
    engine = ctx.ready()
    if config.api_key is None and not config.allow_unauthenticated_lora_loading:
        raise APIError(403, "loading adapters at run time needs the server's --api-key "
                            "(or, on a trusted network, --allow-unauthenticated-lora-"
                            "loading)", code="lora_loading_disabled")
    if not config.lora_roots:
        raise APIError(403, "loading adapters at run time is off: start the server with "
                            "--lora-root DIR, the folder adapters may be loaded from",
                       code="lora_loading_disabled")
    if body.lora_path is None:
        raise APIError(400, "lora_path is required: the adapter folder to load",
                       param="lora_path")
    path = inside(body.lora_path, config.lora_roots, "lora_path", "--lora-root")
    if body.lora_name == ctx.name:
        raise APIError(400, f"lora_name `{ctx.name}` is the base model's name; choose another",
                       param="lora_name")
    try:
        await engine.add_adapter(body.lora_name, str(path))
    except (AdapterError, CheckpointError) as error:
        raise APIError(400, str(error), param="lora_path") from None
    log.info("loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: LoraAdapterRequest, request: Request) -> Response:
    engine = serving(request).ready()
    try:
        await engine.remove_adapter(body.lora_name)
    except AdapterError as error:
        raise APIError(404, str(error), param="lora_name", code="model_not_found") from None
    log.info("unloaded LoRA adapter %r", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                             "successfully.")


@router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
    """New weights for the served model (a trainer's push, TRL's vllm-serve role):
    admission pauses while the running requests finish on the old weights."""
    ctx = serving(request)
    engine = ctx.ready()
    if ctx.config.api_key is None:
        raise APIError(403, "updating weights needs the server's --api-key",
                       code="weight_updates_disabled")
    if not ctx.config.weight_roots:
        raise APIError(403, "updating weights is off: start the server with "
                            "--weights-root DIR, the folder pushes may be read from",
                       code="weight_updates_disabled")
    path = inside(body.path, ctx.config.weight_roots, "path", "--weights-root")
    try:
        version = await engine.update_weights(path)
    except (CheckpointError, RuntimeError) as error:
        raise APIError(400, str(error), param="path") from None
    log.info("loaded weights version %d from %s", version, path)
    return {"status": "ok", "weight_version": version}
