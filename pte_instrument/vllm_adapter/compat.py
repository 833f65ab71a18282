"""Every read of vLLM's configuration and request naming that both processes need, in one
place, so that a vLLM upgrade changes one file. Imported by the scheduler hook (engine
core) and by the stat logger (API server); nothing here imports the server side.

Every vLLM module, class, method signature and field read here and in the rest of the
adapter is declared in ``scripts/vllm_contract.py``, which checks a vLLM release's files for
them (``make compat``: 0.32 and 0.33 both pass); the request-id formats below are behaviour,
which the end-to-end tests check. Where a name moved between releases, the function tries
each location, newest first, and the contract lists them all."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vllm.config import VllmConfig

from pte_instrument.cost.model import CostModel, cost_model_for
from pte_instrument.settings import Settings


def served_model_name(vllm_config: VllmConfig) -> str:
    mc = vllm_config.model_config
    name = mc.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or mc.model)


def lora_enabled(vllm_config: VllmConfig) -> bool:
    """The server serves LoRA adapters (``--enable-lora``)."""
    return getattr(vllm_config, "lora_config", None) is not None


def api_keys(args: Any) -> list[str]:
    """The API keys vLLM's server checks, by its own rule: ``--api-key`` over ``VLLM_API_KEY``."""
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")]
    return [k for k in keys if k]


def app_args(app: Any) -> Any:
    """The server's parsed command line, which vLLM keeps on the app's state (None: none)."""
    return getattr(getattr(app, "state", None), "args", None)


def served_lora_adapters(app: Any) -> Mapping[str, Any] | None:
    """The LoRA adapters the API server serves, by name, as vLLM keeps them (its
    ``OpenAIServingModels.lora_requests`` on the app's state: the ``--lora-modules`` and any
    loaded at run time, live). vLLM serves a request's ``model`` as the adapter of that name
    before anything else. None when the app has no such state."""
    models = getattr(getattr(app, "state", None), "openai_serving_models", None)
    adapters = getattr(models, "lora_requests", None)
    return adapters if isinstance(adapters, Mapping) else None


def served_architecture(vllm_config: VllmConfig) -> dict[str, Any]:
    """The model's Hugging Face text config, with the dtype actually served."""
    mc = vllm_config.model_config
    cfg: dict[str, Any] = mc.hf_text_config.to_dict()
    cfg["torch_dtype"] = str(mc.dtype).removeprefix("torch.")
    return cfg


def kv_cache_dtype(vllm_config: VllmConfig) -> str | None:
    return vllm_config.cache_config.cache_dtype


def cost_model_from_vllm(vllm_config: VllmConfig, settings: Settings) -> CostModel:
    return cost_model_for(
        served_architecture(vllm_config),
        kv_cache_dtype(vllm_config),
        device=settings.device,
        hoi=settings.hoi,
        n_active=settings.n_active,
    )


def weight_bytes(vllm_config: VllmConfig) -> float:
    """Bytes per weight as served (bf16: 2)."""
    return float(vllm_config.model_config.dtype.itemsize)


def kv_block_size(vllm_config: VllmConfig) -> int:
    return int(vllm_config.cache_config.block_size or 1)


def async_scheduling(vllm_config: VllmConfig | None) -> bool:
    """Whether the engine schedules asynchronously (step N+1 before step N's outputs): the
    GPU builds' default, settled by the time the engine builds its scheduler."""
    return bool(vllm_config is not None and vllm_config.scheduler_config.async_scheduling)


def prompt_length(new_request: Any) -> int:
    """A ``NewRequestData``'s prompt length (token ids, or embeddings)."""
    if new_request.prompt_token_ids is not None:
        return len(new_request.prompt_token_ids)
    embeds = new_request.prompt_embeds
    return int(embeds.shape[0]) if embeds is not None else 0


def gpus_per_engine(vllm_config: VllmConfig) -> int:
    """GPUs one engine (data-parallel rank) runs on: tensor × pipeline parallel."""
    pc = vllm_config.parallel_config
    return max(1, int(pc.tensor_parallel_size or 1)) * max(1, int(pc.pipeline_parallel_size or 1))


def api_server_index(vllm_config: VllmConfig) -> int:
    """This API server's index (vLLM's client index) among ``--api-server-count`` servers."""
    return max(0, int(getattr(vllm_config.parallel_config, "_api_process_rank", 0) or 0))


def api_server_count(vllm_config: VllmConfig) -> int:
    return max(1, int(getattr(vllm_config.parallel_config, "_api_process_count", 1) or 1))


TCP_PORT_OFFSET = 100  # the transport's TCP base port: vLLM's data-parallel RPC port + this


def engine_transport(vllm_config: VllmConfig, configured: str | None) -> str | None:
    """The engine → API-server transport base. ``PTE_ENGINE_TRANSPORT=tcp`` (set on every
    node, for engines started ``--headless`` on other nodes): TCP on vLLM's data-parallel
    master address at its RPC port + ``TCP_PORT_OFFSET`` — settings every node is given, and
    that an engine keeps after vLLM resets its other data-parallel fields. Any other value
    (an ``ipc://`` base the processes inherit, or a ``tcp://host:port`` base) as it is."""
    if configured is None or configured.strip().lower() != "tcp":
        return configured
    pc = vllm_config.parallel_config
    return f"tcp://{pc.data_parallel_master_ip}:{int(pc.data_parallel_rpc_port) + TCP_PORT_OFFSET}"


def engine_index(vllm_config: VllmConfig) -> int:
    """The data-parallel engine index: vLLM resets ``data_parallel_rank`` to 0 in non-MoE
    DP engines; ``data_parallel_index`` keeps it."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_index", None) or pc.data_parallel_rank or 0)


def external_request_id(internal: str) -> tuple[str, int | None]:
    """The id the API server knows and, for a parallel-sampling child, its index.

    vLLM's engine names a request ``<external id>-<8 random hex>``; with ``n > 1`` the
    children are ``<index>_<parent's engine id>`` and report their finish under the
    parent's external id."""
    head, dash, tail = internal.rpartition("-")
    external = head if dash and len(tail) == 8 and all(ch in "0123456789abcdef" for ch in tail) else internal
    index, underscore, parent = external.partition("_")
    if underscore and index.isdigit() and parent:
        return parent, int(index)
    return external, None


def finished_counts(request: Any) -> dict[str, float]:
    """What the engine knows of a finished ``vllm.v1.request.Request``: enough to account a
    request whose stats the API server never gets, and the API server it came from."""
    return {
        "prompt_tokens": request.num_prompt_tokens,
        "output_tokens": request.num_output_tokens,
        "num_preemptions": request.num_preemptions,
        "api_server": request.client_index,
        "arrival_time": request.arrival_time,
    }


def request_keys(request_id: str) -> tuple[str, ...]:
    """Spellings of the X-Request-Id the session middleware registered: vLLM names a
    request ``<kind>-<X-Request-Id>`` (``chatcmpl-…``) and the completions API appends
    ``-<prompt index>`` (``cmpl-<id>-0``); the chat batch API appends ``_<conversation>``
    (``chatcmpl-<id>_0``), and the Responses API names each engine request of a response
    ``<request_id>_<n>`` after the body's ``request_id`` (``resp_<uuid>_0``). A request the
    engine hook took for a parallel-sampling child (``<index>_<…>``: a Responses API
    ``request_id`` of that form) is also known by the name the hook gave it."""
    keys = [request_id]
    kind, sep, base = request_id.partition("-")
    if sep:
        head, dash, index = base.rpartition("-")
        indexed = bool(dash and index.isdigit())
        # a completions request (or its child, ``<n>_cmpl-…``) always carries its prompt's index:
        # its id with the index is another request's X-Request-Id, never its own
        if not (indexed and kind.rpartition("_")[2] == "cmpl"):
            keys.append(base)
        if indexed:
            keys.append(head)
    for key in keys[:]:
        head, underscore, index = key.rpartition("_")
        if underscore and head and index.isdigit():
            keys.append(head)
    external, child = external_request_id(request_id)
    if child is not None:
        keys.append(external)
    return tuple(dict.fromkeys(keys))


def prompt_index(request_id: str) -> int | None:
    """Which prompt of its completions request a request served (``cmpl-<id>-<index>``); None
    for the other routes, whose requests carry one prompt."""
    kind, _, rest = request_id.partition("-")
    head, dash, index = rest.rpartition("-")
    return int(index) if kind == "cmpl" and dash and head and index.isdigit() else None


def cli_env_setup() -> None:
    """vLLM's CLI environment set-up: ``vllm.entrypoints.common.startup`` from 0.33,
    ``vllm.entrypoints.serve.utils.api_utils`` in 0.32."""
    try:
        from vllm.entrypoints.common.startup import cli_env_setup as setup
    except ImportError:
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as setup
    setup()
