"""LoRA adapters on the simulated worker, as vLLM 0.32 serves them with `--enable-lora --lora-modules ...`.

    modules = parse_lora_modules(["sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}'])
    check_lora_modules(modules, served="llama-3-8b")   # ValueError: vLLM's startup refusals

What vLLM does, and this mirrors:

- `--lora-modules` (vllm/entrypoints/launchers/cli_args.py, `LoRAParserAction`): one or more items after
  the flag; an item with `=` and no `,` is `name=path` (split at the first `=`), any other is a JSON object
  of `LoRAModulePath` fields (`name`, `path`, `base_model_name`, `is_3d_lora_weight`); bad JSON or fields
  are argparse errors in vLLM's words. A later `--lora-modules` replaces an earlier one (argparse's setattr).
- Static adapters load at startup (`OpenAIServingModels.init_static_loras`), refused, so the server does not
  start, when a name or path is empty, the name is a served base model's, or the name was loaded already.
- A request whose `model` is an adapter's name runs with it and is answered with that name as `model`
  (`OpenAIServingModels.model_name(lora_request)`); `/v1/models` lists the base card, then one card per
  adapter in load order (`show_available_models`: `id` the name, `root` the path, `parent` the base model's
  served name, `max_model_len` null, one `ModelPermission`).
- `vllm:lora_requests_info` (vllm/v1/metrics/loggers.py, stats.py `LoRARequestStates`): a gauge labelled
  `max_lora`, `waiting_lora_adapters`, `running_lora_adapters`, set to the wall-clock time at every engine
  step. The API server's output processor tracks each adapter's requests from the engine events that come
  with a request's *outputs*, so a request counts from its first token until it finishes or is aborted; an
  adapter is listed (in the order it started being tracked) while it has one such request, and both labels
  list the same adapters (vLLM fills both dicts with every tracked adapter, its count 0 or not). vLLM never
  removes a label set: every distinct set seen stays a series, and the current one is the one with the
  largest value. The series are not bounded (as in vLLM): one per distinct adapter list seen.

Runtime updating (`RuntimeLoras`; vLLM 0.32's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
vllm/entrypoints/serve/lora/api_router.py, attached only when env `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is "1" or
"true" in any case, vllm/envs.py): the body is FastAPI's (`fastapi_body`: JSON only, vLLM's
`validate_json_request`, then pydantic's lax validation of vLLM's request models), then
`OpenAIServingModels.load_lora_adapter` / `unload_lora_adapter` (vllm/entrypoints/openai/models/serving.py):
its checks in its order and words, answered 200 with a plain-text body and no content type (Starlette's
`Response(content=...)`), or its `create_error_response` JSON (messages through vLLM's `sanitize_message`).
A load replaces an in-place reload's entry where it was (so `/v1/models` keeps its place) and appends a new
one; an unload only drops the name: vLLM's engine keeps the adapter, and requests running with it finish.
The simulator reads no weights: an absolute (or `~`) `lora_path` without an `adapter_config.json` gets
vLLM's 404 for an adapter its loader cannot find; any other path (a Hugging Face id, a relative path) is
accepted, where vLLM would download or read it and may refuse it (bad rank, offline hub, ...).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from simulator.engine_types import vllm_env_flag
from simulator.protocol import ApiError, bad_shape, parse_body, sanitize_message, validated

LORA_INFO = "vllm:lora_requests_info"
LORA_INFO_HELP = "Running stats on lora requests."
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")  # vLLM's labelnames order


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One static adapter: vLLM's `LoRAModulePath` (its fields, so a JSON item takes the same keys)."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM keeps it only when it is a served base model's name
    is_3d_lora_weight: bool = False  # read by vLLM's loader; nothing to the simulator


def parse_lora_modules(items: Iterable[str | None]) -> tuple[LoraModule, ...]:
    """The values after one `--lora-modules`, read as vLLM's `LoRAParserAction` reads them; ValueError in its
    words ("Invalid JSON format for --lora-modules: ...", "Invalid fields for --lora-modules: ... - ...")."""
    modules: list[LoraModule] = []
    for item in items:
        if item in (None, ""):  # vLLM skips empty items
            continue
        assert item is not None
        if "=" in item and "," not in item:  # the old format, name=path
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            fields = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            modules.append(LoraModule(**fields))
        except TypeError as exc:  # unknown or missing keys, or not an object
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None
    return tuple(modules)


def check_lora_modules(modules: Sequence[LoraModule], served: str) -> None:
    """vLLM's checks when it loads the static adapters at startup (`_check_load_lora_adapter_request`, in
    load order); the first failure stops the server, in vLLM's words."""
    loaded: set[str] = set()
    for m in modules:
        if not isinstance(m.name, str) or not isinstance(m.path, str):  # a JSON item's numbers, lists, ...
            raise ValueError(f"a LoRA module's name and path must be strings, got {m.name!r} and {m.path!r}")
        if not m.name or not m.path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        if m.name == served:
            raise ValueError(f"The lora adapter '{m.name}' conflicts with a served base model.")
        if m.name in loaded:
            raise ValueError(
                f"The lora adapter '{m.name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True."
            )
        loaded.add(m.name)


def model_card(module: LoraModule, served: str) -> dict[str, Any]:
    """An adapter's `/v1/models` card: vLLM's `ModelCard(id=name, root=path, parent=base, permission=[...])`
    with the model's other defaults (`max_model_len` None, `created` now) dumped whole."""
    return {
        "id": module.name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        "root": module.path, "parent": served, "max_model_len": None, "permission": [model_permission()],
    }  # fmt: skip


def model_permission() -> dict[str, Any]:
    """vLLM's `ModelPermission()` defaults, dumped (`id` = "modelperm-" + vLLM's random_uuid: 16 hex)."""
    return {
        "id": f"modelperm-{uuid_hex16()}", "object": "model_permission", "created": int(time.time()),
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False,
    }  # fmt: skip


def uuid_hex16() -> str:
    """vLLM's `random_uuid()`: the low 64 bits of a uuid4, as 16 hex digits."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class LoraRequestStates:
    """The API server's per-adapter request tracking and the `vllm:lora_requests_info` series it sets.

    `started(rid, adapter)` when a request's first token is delivered, `finished(rid, adapter)` when it
    finishes or is aborted (a no-op for one never started), `record()` at each engine step. `clock` gives
    the gauge's value (vLLM's `set_to_current_time`: the wall clock)."""

    def __init__(self, max_loras: int, clock: Callable[[], float] = time.time) -> None:
        self.max_lora = str(max_loras)
        self.clock = clock
        self.requests: dict[str, set[str]] = {}  # adapter → its tracked requests, in tracking order
        self.series: dict[tuple[str, str, str], float] = {}  # label values → last value, first-set order

    def started(self, request_id: str, adapter: str) -> None:
        self.requests.setdefault(adapter, set()).add(request_id)

    def finished(self, request_id: str, adapter: str) -> None:
        ids = self.requests.get(adapter)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self.requests[adapter]

    def record(self) -> None:
        names = ",".join(self.requests)
        self.series[(self.max_lora, names, names)] = self.clock()


# ---------------------------------------------------------------- runtime updating

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# what vLLM's engine core answers an `add_lora` on a server started without --enable-lora (the worker's
# `_ensure_lora_enabled`, wrapped by EngineCoreProc._invoke_utility_method); the API server makes it a 500
LORA_NOT_ENABLED = "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA."

ModelT = TypeVar("ModelT", bound=BaseModel)


def runtime_lora_updating(environ: Mapping[str, str]) -> bool:
    """vLLM's `envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`vllm_env_flag`)."""
    return vllm_env_flag(environ, RUNTIME_LORA_ENV)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest` (vllm/entrypoints/serve/lora/protocol.py): its fields, types, defaults."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest`; `lora_int_id` is validated and then ignored, as vLLM ignores it."""

    lora_name: str
    lora_int_id: int | None = None


def fastapi_body(raw: bytes, content_type: str | None, model: type[ModelT]) -> ModelT:
    """A POST body as vLLM's FastAPI route with `Depends(validate_json_request)` and a pydantic body reads it
    (`protocol.parse_body`), then the model validated as FastAPI does (`from_attributes`), each field's type;
    or the ApiError vLLM answers (400 "Bad Request", param the error's location)."""
    body = parse_body(raw, content_type)
    try:
        return validated(model, body)
    except ApiError as exc:  # vLLM sanitizes these messages too (a path-like string value is an `input`)
        raise bad_shape(sanitize_message(exc.message), exc.param) from None


def _error(status: int, message: str, type_: str) -> ApiError:
    """vLLM's `create_error_response(message, err_type, status_code)`: no param, the message sanitized."""
    return ApiError(status, sanitize_message(message), type_)


def _adapter_found(path: str) -> bool:
    """Whether vLLM's LoRA loader would find the adapter, as far as the simulator can tell without reading
    it: `get_adapter_absolute_path` takes an absolute path (or `~`-expanded one) as it is and
    `PEFTHelper.from_local_dir` opens its `adapter_config.json` (FileNotFoundError → vLLM's
    LoRAAdapterNotFoundError); other paths are a Hugging Face id or a relative directory, not checked."""
    if os.path.isabs(path) or path.startswith("~"):
        return os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json"))
    return True


class RuntimeLoras:
    """vLLM's `OpenAIServingModels.load_lora_adapter` / `unload_lora_adapter` over the worker's adapters
    (`loras`: name → module, in load order, shared with the request parsing that resolves names).

    `enabled`: the server has LoRA (vLLM's --enable-lora or adapters); without it every load that passes the
    checks is the engine's 500. The simulator's event loop runs each call to completion, so vLLM's per-name
    lock has nothing to guard here."""

    def __init__(self, loras: MutableMapping[str, LoraModule], served: str, enabled: bool) -> None:
        self.loras = loras
        self.served = served
        self.enabled = enabled

    def load(self, req: LoadLoraAdapterRequest) -> str:
        """The success text, or the ApiError vLLM answers (400 InvalidUserInput for its checks, in its order;
        then its engine's add_lora: 500 without LoRA, 404 NotFoundError for an adapter not found)."""
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.served:  # vLLM's is_base_model: the served names only
            raise _error(
                400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
            )
        if not req.load_inplace and name in self.loras:
            raise _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if not self.enabled:
            raise _error(500, LORA_NOT_ENABLED, "InternalServerError")
        if not _adapter_found(path):  # vLLM's LoRAAdapterNotFoundError, through create_error_response
            raise _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        # a name loaded in place keeps its place (dict order: /v1/models lists it where it was)
        self.loras[name] = LoraModule(name, path, is_3d_lora_weight=req.is_3d_lora_weight)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: UnloadLoraAdapterRequest) -> str:
        """The success text, or vLLM's 400 (no name) / 404 (a name not loaded). A static adapter unloads too."""
        name = req.lora_name
        if not name:
            raise _error(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        if name not in self.loras:
            raise _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loras[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
