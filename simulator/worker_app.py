"""The simulated vLLM worker: a FastAPI app speaking vLLM's OpenAI server surface over the engine model.

    app = create_worker_app(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=10.0))
    app.state.worker -> WorkerRuntime   (engine, driver, metrics, faults; `await aclose()` when not served
                                         by uvicorn — the app's lifespan does it otherwise)

Routes (vLLM's): POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/responses/{id} and
POST /v1/responses/{id}/cancel (vLLM's 404: nothing is stored)
(`simulator.responses_api`), GET /v1/models, POST /tokenize,
POST /detokenize (`simulator.tokenize_api`), GET /health, GET /metrics. Simulator-only (not in vLLM, under /sim/): GET|POST /sim/faults (failure injection at
run time), POST /sim/kv/release (P/D: the decode side tells the prefill side its KV was fetched),
GET /sim/state (engine state as JSON). See docs/worker.md.

P/D (vLLM's NixlConnector protocol, simulated). A `prefill` worker given
`kv_transfer_params.do_remote_decode=true` prefills and answers with `kv_transfer_params`
{do_remote_prefill: true, do_remote_decode: false, remote_engine_id, remote_block_ids, remote_host,
remote_port, remote_request_id, tp_size}, holding the blocks until released or `kv_hold_timeout_s`.
A `decode` worker given `do_remote_prefill=true` allocates the prompt's blocks, waits
prompt_tokens · kv_bytes_per_token / (kv_link_gbps · 10⁹) s of simulated time, computes the last prompt
token, decodes, and POSTs /sim/kv/release to remote_host:remote_port (best effort). A `mixed` worker, or a
role that does not match the params, answers `kv_transfer_params: null` like vLLM without a connector.

Data parallelism (`data_parallel_size` N > 1, vLLM's `--data-parallel-size`): N engines, each with its own
driver, clock, KV cache of the configured blocks and the same perf model, behind this one API server. A
request runs on the engine its `X-data-parallel-rank` header names (a rank outside [0, N) is refused as
vLLM refuses it), else on the one vLLM's balancer would pick (`simulator.data_parallel`); all sequences of
one API request run on the same engine (vLLM balances each of `n`'s child requests on its own: the
simulator's sequences of a request share one wake-up event, so they stay together). Aborts and
disconnects reach the engine running the request. A prefill engine's `remote_engine_id` is the worker's
engine id with `_dp<rank>` appended, as vLLM suffixes each DP engine's KV-connector id; `remote_port` stays
this server's (the simulated release goes to /sim/kv/release, which finds the engine holding the blocks).
`/sim/state` sums the engines (KV usage: their mean; blocks: the server's total, as `cache_config_info`)
and lists each under `engines`. N = 1 answers exactly as a worker without data parallelism.

Runners (`runner`, vLLM's `--runner`): "generate" serves the routes above; "pooling" is an embedding server
(`vllm serve MODEL --runner pooling --convert embed`): POST /v1/embeddings (`simulator.embeddings`), and the
bi-encoder score and rerank routes POST /score, /v1/score, /rerank, /v1/rerank, /v2/rerank
(`simulator.scoring`), instead of /v1/completions, /v1/chat/completions and /v1/responses[/...], which are
then unknown paths (vLLM's 404 `{"detail": "Not Found"}`; the pooling routes are unknown on a generate
worker likewise). Each input of an embeddings request, and each query and each document of a score or rerank
request (queries once, not once per pair), is one prefill-only engine request (`EngineRequest.pooling`), all
submitted together; mixed role only (vLLM has no P/D for pooling).

LoRA (`lora_modules`, vLLM's `--enable-lora --lora-modules ...`; `simulator.lora`): a request whose `model`
is an adapter's name (completions, chat, the Responses API, /tokenize, /detokenize) is served with it and
answered with that name as `model`; its engine requests carry the adapter, so the engine's `max_loras`
admission rule applies (`EngineConfig.max_loras`, vLLM's --max-loras, default 1). `/v1/models` lists the
base card then one card per adapter, and `/metrics` adds `vllm:lora_requests_info`. An adapter costs no time.
With `allow_runtime_lora_updating` (vLLM's env VLLM_ALLOW_RUNTIME_LORA_UPDATING) POST /v1/load_lora_adapter
and /v1/unload_lora_adapter change the adapters at run time (`simulator.lora.RuntimeLoras`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.data_parallel import RANK_HEADER, DpBalancer, EngineLoad, requested_rank
from simulator.embeddings import EmbedRequest, embedding, embeddings_body, embeddings_bytes, parse_embeddings
from simulator.engine import Engine, EngineConfig
from simulator.fingerprint import VLLM_VERSION, system_fingerprint
from simulator.lora import (
    LoadLoraAdapterRequest,
    LoraModule,
    LoraRequestStates,
    RuntimeLoras,
    UnloadLoraAdapterRequest,
    check_lora_modules,
    fastapi_body,
    model_card,
    model_permission,
)
from simulator.metrics import WorkerMetrics
from simulator.protocol import (
    ApiError,
    ApiRequest,
    ChunkWriter,
    EngineInputError,
    chat_body,
    check_request,
    completion_body,
    logprobs_body,
    parse_body,
    parse_json_body,
    parse_request,
)
from simulator.requests import (
    EngineRequest,
    FinishReason,
    KvTransfer,
    RequestRecord,
    prompt_fingerprint,
    sample_natural_output,
)
from simulator.responses_api import (
    EventWriter,
    ResponsesFields,
    message_item,
    new_ids,
    not_found,
    parse_responses,
    response_body,
)
from simulator.scoring import architecture, pair_scores, parse_scoring, rerank_body, score_body
from simulator.tokenize_api import detokenize_body, tokenize_body
from simulator.tokens import VOCAB_SIZE, id_text, pseudo_top_logprobs, pseudo_words
from simulator.worker_runtime import EngineDriver, Ticket

ROLES = ("mixed", "prefill", "decode")
RUNNERS = ("generate", "pooling")  # vLLM's --runner: text generation, or an embedding (pooling) server
MIN_TIME_SCALE = 1e-3  # time_scale floor: at most 1000× slower than real time
_MASK64 = (1 << 64) - 1
_SEQUENCE_MIX = 0x9E3779B97F4A7C15  # spreads completion j of a prompt over the fingerprint's bits


async def _error_stream(err: ApiError) -> AsyncIterator[str]:
    yield ChunkWriter.error(err)
    yield ChunkWriter.done()


async def _echo_only_stream(
    api: ApiRequest, writer: ChunkWriter, tickets: list[Ticket]
) -> AsyncIterator[str]:
    """vLLM's stream of an echo without generation (completions' echo, max_tokens 0): per sequence one event
    with the prompt's text (the simulator's own words for a token-id prompt) and finish_reason `length`, the
    usage event when asked for (the one sampled token counted), then [DONE]."""
    for tk in tickets:
        await tk.wait_done()
    raw = api.params.prompt if api.params is not None else None
    texts = (
        [raw]
        if isinstance(raw, str)
        else list(raw)
        if isinstance(raw, list) and raw and not isinstance(raw[0], int)
        else []
    )
    for p, ids in enumerate(api.prompts):
        text = texts[p] if p < len(texts) and isinstance(texts[p], str) else "".join(map(id_text, ids))
        for j in range(api.n):
            yield writer.token(text, "length", index=p * api.n + j)
    if api.include_usage:
        yield writer.usage(sum(map(len, api.prompts)), api.sequences)
    yield ChunkWriter.done()


@dataclass(frozen=True, slots=True)
class ApiSequence:
    """One sequence of an API request: its engine request, the fingerprint its words are drawn from, and
    its prompt's tokens."""

    request: EngineRequest
    fingerprint: int
    prompt_tokens: int


@dataclass(slots=True)
class FaultConfig:
    """Failure injection for reliability tests; probabilities per request, drawn from the worker's seed."""

    error_rate: float = 0.0  # answer 500 before any byte
    stall_rate: float = 0.0  # hold the request `stall_s` wall seconds before handling it
    stall_s: float = 0.0
    midstream_error_rate: float = 0.0  # streams: end with an error event halfway through
    healthy: bool = True  # False → /health answers 503

    def validate(self) -> None:
        for name in ("error_rate", "stall_rate", "midstream_error_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not (math.isfinite(self.stall_s) and self.stall_s >= 0):  # NaN passed `< 0` and meant no stall
            raise ValueError(f"stall_s must be a finite number ≥ 0, got {self.stall_s}")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one simulated worker needs. `served_model_name` None → the catalog model name."""

    gpu: str = "H100"
    model: str = "llama-3-8b"
    role: str = "mixed"
    tp: int = 1
    time_scale: float = 1.0
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    catalog_path: str | None = None  # YAML rows merged over the built-in catalog
    kv_link_gbps: float = 25.0  # GB/s the decode side pulls KV at (≈ a 200 Gb/s RDMA NIC)
    kv_hold_timeout_s: float = 480.0  # simulated s a prefill worker keeps unfetched KV (vLLM's NIXL default)
    faults: FaultConfig = field(default_factory=FaultConfig)
    advertise_host: str = "127.0.0.1"  # remote_host in kv_transfer_params
    advertise_port: int = 0  # remote_port; start_worker_server fills in the bound port
    engine_id: str | None = None  # remote_engine_id; None → random
    data_parallel_size: int = 1  # engines behind the one API server (vLLM's --data-parallel-size)
    # static LoRA adapters (vLLM's --lora-modules); how many one step may run is `engine.max_loras`
    # (--max-loras). LoRA is on with adapters, or with `enable_lora` alone (vLLM's --enable-lora, none loaded)
    lora_modules: tuple[LoraModule, ...] = ()
    enable_lora: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: env VLLM_ALLOW_RUNTIME_LORA_UPDATING); it
    # does not turn LoRA on: without it a load is vLLM's 500 "LoRA is not enabled"
    allow_runtime_lora_updating: bool = False
    # vLLM's --runner: "generate" (completions, chat, responses) or "pooling" (an embedding server, as
    # `--runner pooling --convert embed`: /v1/embeddings, /score and /rerank)
    runner: str = "generate"

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.runner == "pooling" and self.role != "mixed":
            raise ValueError(
                f"runner 'pooling' needs role 'mixed', got {self.role!r}: vLLM disaggregates prefill and "
                "decode for generation only"
            )
        if isinstance(self.data_parallel_size, bool) or not (
            isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1
        ):
            raise ValueError(f"data_parallel_size must be an integer ≥ 1, got {self.data_parallel_size!r}")
        # before the heads-divisible check, which divides by it
        if isinstance(self.tp, bool) or not (isinstance(self.tp, int) and self.tp >= 1):
            raise ValueError(f"tp must be an integer ≥ 1, got {self.tp!r}")
        # NaN fails both; inf would freeze simulated time at its anchor; below MIN_TIME_SCALE a request's
        # few simulated seconds take wall-clock days (1e-300: every request hung)
        if not MIN_TIME_SCALE <= self.time_scale < math.inf:
            raise ValueError(
                f"time_scale must be a finite number ≥ {MIN_TIME_SCALE:g} (at most 1000× slower than real "
                f"time), got {self.time_scale}"
            )
        if not (math.isfinite(self.kv_link_gbps) and self.kv_link_gbps > 0):  # NaN: transfers never ended
            raise ValueError(f"kv_link_gbps must be a finite number > 0, got {self.kv_link_gbps}")
        self.faults.validate()


class WorkerRuntime:
    """The app's state: engines + their drivers + metrics + P/D holds + faults. Built by `create_worker_app`.

    `engines`, `drivers`, `engine_metrics`: one per data-parallel rank; `engine`, `driver`, `metrics` are
    rank 0's (the only ones without data parallelism; `metrics.render()` is the whole server's)."""

    def __init__(self, cfg: WorkerConfig) -> None:
        cfg.validate()
        catalog = load_catalog(cfg.catalog_path)
        self.cfg = cfg
        model = catalog.model(cfg.model)
        tp_error = model.tp_error(cfg.tp)  # vLLM's own check, in its words
        if tp_error is not None:
            raise ValueError(tp_error)
        self.perf = PerfModel(catalog.gpu(cfg.gpu), model, tp=cfg.tp)
        self.served = cfg.served_model_name or self.perf.model.name
        check_lora_modules(cfg.lora_modules, self.served)  # vLLM refuses to start on these too
        # adapter name → module, in load order; runtime loads and unloads change it in place, so the request
        # parsers given it see the current adapters
        self.loras = {m.name: m for m in cfg.lora_modules}
        self.lora_enabled = bool(cfg.lora_modules) or cfg.enable_lora
        self.runtime_loras = RuntimeLoras(self.loras, self.served, self.lora_enabled)
        # Every engine gets the worker's seed: DP engines are replicas of one model, so a prompt's answer
        # does not depend on which engine runs it (vLLM at temperature 0 likewise).
        self.engines = [Engine(self.perf, cfg.engine, seed=cfg.seed) for _ in range(cfg.data_parallel_size)]
        self.engine = self.engines[0]
        # vLLM's `system_fingerprint` on every completion (the whole answer, a stream's last events)
        self.fingerprint = system_fingerprint(
            self.perf.model.name,
            cfg.tp,
            cfg.data_parallel_size,
            {
                "max_model_len": self.engine.max_model_len,
                "max_num_seqs": cfg.engine.max_num_seqs,
                "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
                "block_size": cfg.engine.block_size,
                "max_loras": cfg.engine.max_loras if self.lora_enabled else None,
            },
        )
        lora = LoraRequestStates(cfg.engine.max_loras) if self.lora_enabled else None
        self.metrics = WorkerMetrics(self.engine, self.served, lora=lora)
        self.engine_metrics = [self.metrics, *(self.metrics.add_engine(e) for e in self.engines[1:])]
        self.drivers = [
            EngineDriver(e, m, cfg.time_scale) for e, m in zip(self.engines, self.engine_metrics, strict=True)
        ]
        self.driver = self.drivers[0]
        for driver in self.drivers:
            driver.on_kv_received = self._kv_received
        self._balancer = DpBalancer()
        self.faults = FaultConfig(**asdict(cfg.faults))
        self.rng = random.Random(cfg.seed)
        self.engine_id = cfg.engine_id or f"sim-{secrets.token_hex(6)}"
        self.advertise_port = cfg.advertise_port
        self._next_block_id = 1
        self._holds: dict[
            int, tuple[int, str]
        ] = {}  # first remote block id → (rank, request id) (prefill side)
        self._remote: dict[str, dict[str, Any]] = {}  # request id → kv_transfer_params (decode side)
        self._client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def inflight(self) -> int:
        """Sequences the engines are running or queueing (P/D holds not included: `num_held`)."""
        return sum(d.inflight for d in self.drivers)

    @property
    def num_held(self) -> int:
        return sum(e.num_held for e in self.engines)

    def abort_all(self) -> int:
        """Abort every request of every engine (the server is stopping): `EngineDriver.abort_all`."""
        return sum(d.abort_all() for d in self.drivers)

    def expire_held(self) -> None:
        """Free P/D holds past their timeout now (a scrape reads usage) and step an engine that can admit."""
        for driver in self.drivers:
            if driver.engine.expire_held(driver.now()):
                driver.kick()

    def engine_for(self, rank: int | None) -> int:
        """The engine a request runs on: the rank it names (checked already), else the balancer's pick."""
        if rank is not None:
            return rank
        if len(self.drivers) == 1:
            return 0
        return self._balancer.pick(
            [
                EngineLoad(
                    d.engine.num_waiting, d.engine.num_running, d.engine.kv_usage, d.inflight + d.arriving
                )
                for d in self.drivers
            ]
        )

    async def aclose(self) -> None:
        for driver in self.drivers:
            await driver.aclose()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------ completions
    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            api = parse_request(body, chat, self.served, self.engine.max_model_len, self.loras)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        # vLLM's response id (`_base_request_id`): the X-Request-Id header, else the body's request_id, else
        # random.
        base = request.headers.get("x-request-id")
        if base is None:
            base = api.request_id if api.request_id is not None else secrets.token_hex(8)
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        admitted = await self._admit(request, api, rid, errors_in_stream=True)
        if isinstance(admitted, Response):
            return admitted
        eid, seqs, tickets, rank, driver = admitted
        faults = self.faults
        if api.stream and api.echo_only:  # vLLM streams an echo without generation as one event per sequence
            writer = ChunkWriter(rid, api.model, api.chat, self.fingerprint, api.include_usage)
            return StreamingResponse(_echo_only_stream(api, writer, tickets), media_type="text/event-stream")
        if api.stream:
            cut = faults.midstream_error_rate and self.rng.random() < faults.midstream_error_rate
            stream = self._stream(api, rid, seqs, tickets, bool(cut), eid, driver)
            return StreamingResponse(stream, media_type="text/event-stream")
        recs = await self._finished_or_disconnected(request, tickets, driver)
        self._abandon_remote(eid)  # aborted before its KV landed: the prefill side frees it now
        if recs is None:
            return Response(status_code=499)  # nobody is listening any more
        k = api.logprobs
        choices = [
            (
                "".join(pseudo_words(self.cfg.seed, seq.fingerprint, 0, rec.output_tokens)),
                rec.finish_reason.value,
                None if k is None else logprobs_body(api.chat, self._tops(seq, 0, rec.output_tokens, k), k),
            )
            for seq, rec in zip(seqs, recs, strict=True)
        ]
        build = chat_body if chat else completion_body
        kvp = self._kv_response(recs[0], rank) if len(recs) == 1 else None
        out = build(rid, api.model, int(time.time()), choices, sum(map(len, api.prompts)),
                    sum(rec.output_tokens for rec in recs), kvp, self.fingerprint)  # fmt: skip
        return JSONResponse(out)

    async def _admit(
        self, request: Request, api: ApiRequest, rid: str, errors_in_stream: bool
    ) -> Response | tuple[str, list[ApiSequence], list[Ticket], int, EngineDriver]:
        """The checks after parsing, the faults, and the engine submission of a parsed request answered with
        id `rid`: (engine id, sequences, tickets, rank, driver), or the error Response. `errors_in_stream`:
        a stream gets the engine input checks' errors as an error event (completions and chat, whose checks
        vLLM runs once the stream has started; the Responses API runs them before)."""
        # The adapter is resolved now, before any await: an unload while this request stalls or queues does not
        # take it away (vLLM resolves its LoRARequest in the handler and the engine keeps running with it).
        lora = api.model if api.model in self.loras else None
        limit = self.engine.max_model_len
        try:
            dp_rank = requested_rank(request.headers.get(RANK_HEADER))
            max_tokens = check_request(
                api, limit, self.perf.model.vocab_size or VOCAB_SIZE, dp_rank, len(self.engines)
            )  # per prompt, clamped to the context it leaves
        except EngineInputError as err:
            if api.stream and errors_in_stream:
                return StreamingResponse(_error_stream(err), media_type="text/event-stream")
            return JSONResponse(err.body(), status_code=err.status)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        failed = await self._inject_faults()
        if failed is not None:
            return failed
        # A client's id may repeat (retries, P/D sending one id to both sides), so the engine gets its own:
        # the response id plus 8 random hex digits, as vLLM's input processor makes it.
        eid = f"{rid}-{secrets.token_hex(4)}"
        seqs = self._sequences(api, eid, max_tokens, lora)
        rank = self.engine_for(dp_rank)
        driver = self.drivers[rank]
        try:
            tickets = await driver.submit_all([s.request for s in seqs], stream=api.stream)
        except ValueError as exc:  # the engine refused what the checks above let through: a 400, not a 500
            self._abandon_remote(eid)
            err = ApiError(400, str(exc))
            return JSONResponse(err.body(), status_code=err.status)
        return eid, seqs, tickets, rank, driver

    async def _inject_faults(self) -> Response | None:
        """The request-level failure injection (`FaultConfig`): maybe stall, then maybe the 500 to answer."""
        faults = self.faults
        if faults.stall_rate and self.rng.random() < faults.stall_rate:
            await asyncio.sleep(faults.stall_s)
        if faults.error_rate and self.rng.random() < faults.error_rate:
            err = ApiError(500, "simulated worker failure (error_rate)", "InternalServerError")
            return JSONResponse(err.body(), status_code=500)
        return None

    def _tops(self, seq: ApiSequence, start: int, stop: int, k: int) -> list[list[tuple[str, float]]]:
        """Tokens start..stop−1 of `seq`'s answer with their max(1, k) most likely candidates."""
        return pseudo_top_logprobs(self.cfg.seed, seq.fingerprint, start, stop, max(1, k))

    def _sequences(
        self, api: ApiRequest, rid: str, max_tokens: list[int], lora: str | None = None
    ) -> list[ApiSequence]:
        """The engine requests of `api`, in choice order (index = prompt · n + completion): vLLM decodes
        every completion of every prompt as its own sequence. `rid` is the request's engine id (unique per
        request); one sequence keeps it (P/D holds and releases name it), several get `rid-<index>`.
        Completion j > 0 of a prompt gets its own answer and EOS position (a fingerprint mixed with j), as
        sampling gives n different completions. `lora`: the adapter they run with (None: the base model)."""
        single = api.sequences == 1
        kvt = self._kv_transfer(api, rid) if single else None
        seqs = []
        for p, ids in enumerate(api.prompts):
            for j in range(api.n):
                index = p * api.n + j
                req = EngineRequest(
                    rid if single else f"{rid}-{index}",
                    ids,
                    max_tokens[p],
                    api.min_tokens,
                    api.ignore_eos,
                    None,
                    kvt,
                    lora,
                )
                fp = prompt_fingerprint(req)
                if j:
                    fp ^= (j * _SEQUENCE_MIX) & _MASK64
                    c = self.engine.config
                    natural = sample_natural_output(
                        self.engine.seed, fp, c.natural_output_mean, c.natural_output_shape
                    )
                    req = dataclasses.replace(req, natural_output_tokens=natural)
                seqs.append(ApiSequence(req, fp, len(ids)))
        return seqs

    async def _finished_or_disconnected(
        self, request: Request, tickets: list[Ticket], driver: EngineDriver
    ) -> list[RequestRecord] | None:
        """Wait for every sequence to finish; if the client disconnects first, abort them (as vLLM does) → None."""

        async def all_done() -> list[RequestRecord]:
            return [await tk.wait_done() for tk in tickets]  # one waiter on their shared event

        waiter = asyncio.ensure_future(all_done())
        listener = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not waiter.done():
                waiter.cancel()
                for tk in tickets:
                    driver.abort(tk)
        return waiter.result() if waiter in done else None

    async def _stream(
        self,
        api: ApiRequest,
        rid: str,
        seqs: list[ApiSequence],
        tickets: list[Ticket],
        cut: bool,
        engine_id: str | None = None,
        driver: EngineDriver | None = None,
    ) -> AsyncIterator[str]:
        """One event per token of each sequence as the engine produces them (each event carries one choice,
        as vLLM's); chat opens with a role event per choice, sent as vLLM sends them: when the engine's first
        output arrives (after prefill and any queueing), right before the first token, not on acceptance.
        `rid`: the response id every chunk carries; `engine_id`: the request's engine id (default `rid`);
        `driver`: the engine's driver that runs it (default rank 0's). `cut`: a simulated failure halfway
        through."""
        w = ChunkWriter(rid, api.model, api.chat, self.fingerprint, api.include_usage)
        driver = driver or self.driver
        seed, cont, k = self.cfg.seed, api.continuous_usage, api.logprobs
        sent = [0] * len(tickets)
        offsets = [0] * len(tickets)  # characters of each choice's text sent: completions' text_offset
        event = tickets[0].event  # shared by the request's sequences
        roles_due = api.chat
        ended = [False] * len(tickets)  # the sequence's finish_reason was sent
        try:
            while True:
                # Cleared before the scan and `produced` read once per pass: a yield can wait on the client's
                # socket while the engine delivers more, which the next pass (not this one) must send.
                event.clear()
                if roles_due and any(tk.produced > 0 or tk.done for tk in tickets):
                    roles_due = False
                    for i, seq in enumerate(seqs):
                        yield w.role((seq.prompt_tokens, 0) if cont else None, i)
                for i, (seq, tk) in enumerate(zip(seqs, tickets, strict=True)):
                    upto = tk.produced
                    if upto <= sent[i]:
                        continue
                    words = pseudo_words(seed, seq.fingerprint, sent[i], upto)
                    tops = self._tops(seq, sent[i], upto, k) if k is not None else None
                    last = tk.record.output_tokens - 1 if tk.done and tk.record is not None else -1
                    for at, word in enumerate(words, start=sent[i]):
                        if cut and tk.request.max_tokens > 1 and at >= tk.request.max_tokens // 2:
                            for other in tickets:
                                driver.abort(other)
                            yield w.error(
                                ApiError(500, "simulated mid-stream failure", "InternalServerError")
                            )
                            yield w.done()
                            return
                        reason = tk.record.finish_reason.value if at == last and tk.record else None
                        lp = None
                        if tops is not None and k is not None:
                            lp = logprobs_body(api.chat, tops[at - sent[i] : at - sent[i] + 1], k, offsets[i])
                            offsets[i] += len(word)
                        yield w.token(word, reason, (seq.prompt_tokens, at + 1) if cont else None, i, lp)
                        ended[i] = ended[i] or reason is not None
                    sent[i] = upto
                if all(tk.done and sent[i] >= tk.produced for i, tk in enumerate(tickets)):
                    break
                if not event.is_set():
                    await event.wait()
            recs = [tk.record for tk in tickets]
            for i, rec in enumerate(recs):
                if rec is not None and not ended[i]:  # aborted (server stopping) after its last token: vLLM
                    usage = (seqs[i].prompt_tokens, sent[i]) if cont else None  # ends it with an empty event
                    yield w.token("", rec.finish_reason.value, usage, i, None)
            if api.include_usage and all(rec is not None for rec in recs):
                yield w.usage(sum(map(len, api.prompts)), sum(rec.output_tokens for rec in recs if rec))
            yield w.done()
        finally:
            for tk in tickets:
                driver.abort(tk)  # no-op once finished; a client disconnect aborts the request
            self._abandon_remote(engine_id or rid)

    # ------------------------------------------------------------ embeddings (runner "pooling")
    async def handle_embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings: every input one prefill-only engine request, submitted together on one engine;
        answered when all have finished (`simulator.embeddings` for the checks and the bodies)."""
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            vocab = self.perf.model.vocab_size or VOCAB_SIZE
            req = parse_embeddings(body, self.served, self.engine.max_model_len, vocab, self.loras)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        # vLLM's `_base_request_id`, as for completions: X-Request-Id, else the body's request_id, else random
        base = request.headers.get("x-request-id")
        if base is None:
            base = req.request_id if req.request_id is not None else secrets.token_hex(8)
        rid = "embd-" + base
        failed = await self._inject_faults()
        if failed is not None:
            return failed
        eid = f"{rid}-{secrets.token_hex(4)}"
        recs = await self._run_pooling(request, req.prompts, req.model, eid)
        if isinstance(recs, Response):
            return recs
        return self._embeddings_response(rid, req)

    async def handle_scoring(self, request: Request, rerank: bool) -> Response:
        """POST /score, /v1/score (`rerank` False) or /rerank, /v1/rerank, /v2/rerank: every query and every
        document one prefill-only engine request, submitted together; answered when all have finished
        (`simulator.scoring` for the checks, the scores and the bodies)."""
        try:
            body = parse_json_body(await request.body(), request.headers.get("content-type"))
            arch = architecture(self.perf.model.name)
            job = parse_scoring(body, rerank, self.served, arch, self.engine.max_model_len, self.loras)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        base = request.headers.get("x-request-id")
        if base is None:
            base = job.request_id if job.request_id is not None else secrets.token_hex(8)
        rid = "score-" + base  # vLLM's ServingScores prefix, for /rerank too
        failed = await self._inject_faults()
        if failed is not None:
            return failed
        recs = await self._run_pooling(request, job.prompts, job.model, f"{rid}-{secrets.token_hex(4)}")
        if isinstance(recs, Response):
            return recs
        scores = pair_scores(job, self.cfg.seed, self.perf.model.hidden_size)
        tokens = sum(map(len, job.prompts))
        if rerank:
            return JSONResponse(rerank_body(rid, job, scores, tokens))
        return JSONResponse(score_body(rid, int(time.time()), job, scores, tokens))

    async def _run_pooling(
        self, request: Request, prompts: list[list[int]], model: str, eid: str
    ) -> list[RequestRecord] | Response:
        """Run `prompts` as engine requests `<eid>-<i>` (vLLM numbers a pooling batch's prompts so) for the
        model answered as `model` (an adapter's name runs with it); their records, or the Response to answer
        (refused by the engine, client gone, aborted by a stop)."""
        lora = model if model in self.loras else None
        reqs = [EngineRequest(f"{eid}-{i}", ids, 0, lora=lora, pooling=True) for i, ids in enumerate(prompts)]
        # vLLM's pooling handlers never hand X-data-parallel-rank to the engine (a rank outside the engines is
        # answered too): the balancer picks
        driver = self.drivers[self.engine_for(None)]
        try:
            tickets = await driver.submit_all(reqs, stream=False)
        except ValueError as exc:  # the engine refused what the checks let through: a 400, not a 500
            err = ApiError(400, str(exc))
            return JSONResponse(err.body(), status_code=err.status)
        recs = await self._finished_or_disconnected(request, tickets, driver)
        if recs is None:
            return Response(status_code=499)  # nobody is listening any more
        if any(rec.finish_reason is FinishReason.ABORT for rec in recs):
            # the server is stopping: vLLM's batch collector then lacks an output and answers this ValueError
            err = ApiError(400, "Failed to generate results for all prompts")
            return JSONResponse(err.body(), status_code=err.status)
        return recs

    def _embeddings_response(self, rid: str, req: EmbedRequest) -> Response:
        dim = self.perf.model.hidden_size
        vectors = [embedding(self.cfg.seed, ids, dim) for ids in req.prompts]
        tokens = sum(map(len, req.prompts))
        created = int(time.time())
        if req.encoding_format in ("bytes", "bytes_only"):
            content, headers = embeddings_bytes(rid, created, req, vectors, tokens)
            return Response(content, media_type="application/octet-stream", headers=headers)
        return JSONResponse(embeddings_body(rid, created, req, vectors, tokens))

    # ------------------------------------------------------------ responses
    async def handle_responses(self, request: Request) -> Response:
        """POST /v1/responses: run as the chat request it maps to (`simulator.responses_api`), answered in
        the Responses shapes; one sequence, so one output item."""
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            f, api = parse_responses(body, self.served, self.engine.max_model_len, self.loras)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        rid, mid = new_ids(f)
        admitted = await self._admit(request, api, rid, errors_in_stream=False)
        if isinstance(admitted, Response):
            return admitted
        eid, seqs, tickets, _, driver = admitted
        created = int(time.time())
        if api.stream:
            events = self._responses_stream(f, rid, mid, created, seqs[0], tickets[0], driver, eid, api.model)
            return StreamingResponse(events, media_type="text/event-stream")
        recs = await self._finished_or_disconnected(request, tickets, driver)
        self._abandon_remote(eid)
        if recs is None:
            return Response(status_code=499)
        rec, seq = recs[0], seqs[0]
        text = "".join(pseudo_words(self.cfg.seed, seq.fingerprint, 0, rec.output_tokens))
        done = (message_item(mid, text), rec.finish_reason.value, seq.prompt_tokens, rec.output_tokens)
        return JSONResponse(response_body(f, rid, api.model, created, done))

    async def _responses_stream(
        self,
        f: ResponsesFields,
        rid: str,
        mid: str,
        created: int,
        seq: ApiSequence,
        tk: Ticket,
        driver: EngineDriver,
        engine_id: str,
        model: str,
    ) -> AsyncIterator[str]:
        """vLLM's event sequence: the response created and in progress, its item and part added, one text
        delta per token as the engine produces it, then the text, part and item done and response.completed
        carrying the whole response with its usage. `model`: the name answered (the served one or an
        adapter's)."""
        w = EventWriter(mid)
        words: list[str] = []
        try:
            for line in w.opening(response_body(f, rid, model, created, None)):
                yield line
            while True:
                tk.event.clear()  # before reading `produced`: what arrives while a yield waits is seen next pass
                upto = tk.produced
                for word in pseudo_words(self.cfg.seed, seq.fingerprint, len(words), upto):
                    words.append(word)
                    yield w.delta(word)
                if tk.done and len(words) >= tk.produced:
                    break
                if not tk.event.is_set():
                    await tk.event.wait()
            rec = tk.record
            if rec is None:  # aborted (the server is stopping): no terminal event, as a cut connection
                return
            text = "".join(words)
            done = (message_item(mid, text), rec.finish_reason.value, seq.prompt_tokens, len(words))
            for line in w.closing(text, response_body(f, rid, model, created, done)):
                yield line
        finally:
            driver.abort(tk)  # no-op once finished; a client disconnect aborts the request
            self._abandon_remote(engine_id)

    # ------------------------------------------------------------ P/D
    def _kv_transfer(self, api: ApiRequest, rid: str) -> KvTransfer | None:
        kvp = api.kv_transfer_params
        if not kvp:
            return None
        role = self.cfg.role
        if role == "prefill" and kvp.get("do_remote_decode"):
            return KvTransfer(prefill_only=True, hold_timeout_s=self.cfg.kv_hold_timeout_s)
        if role == "decode" and kvp.get("do_remote_prefill"):
            self._remote[rid] = kvp
            nbytes = len(api.prompts[0]) * self.perf.model.kv_bytes_per_token
            return KvTransfer(remote_prefilled=True, transfer_delay_s=nbytes / (self.cfg.kv_link_gbps * 1e9))
        return None

    def _kv_response(self, rec: RequestRecord, rank: int = 0) -> dict[str, Any] | None:
        if not rec.held_blocks:
            return None
        first = self._next_block_id
        self._next_block_id += rec.held_blocks
        if len(self._holds) > 2 * self.num_held + 64:  # forget holds that timed out in the engine
            self._holds = {
                b: (k, r) for b, (k, r) in self._holds.items() if self.engines[k].inspect(r) is not None
            }
        self._holds[first] = (rank, rec.request_id)
        # vLLM appends `_dp<rank>` to each DP engine's KV-connector engine id (v1/engine/utils.py)
        engine_id = self.engine_id if len(self.engines) == 1 else f"{self.engine_id}_dp{rank}"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_block_ids": list(range(first, first + rec.held_blocks)),
            "remote_host": self.cfg.advertise_host,
            "remote_port": self.advertise_port,
            "remote_request_id": rec.request_id,
            "tp_size": self.cfg.tp,
        }

    def release_kv(self, body: dict[str, Any]) -> int:
        """Free a hold named by `remote_block_ids` (or `remote_request_id`); returns blocks freed."""
        ids = body.get("remote_block_ids")
        rid = body.get("remote_request_id")
        ranks: range | tuple[int] = range(len(self.engines))  # named by request id only: whichever holds it
        if isinstance(ids, list) and ids and isinstance(ids[0], int) and ids[0] in self._holds:
            rank, rid = self._holds.pop(ids[0])
            ranks = (rank,)
        if not isinstance(rid, str):
            return 0
        for rank in ranks:
            freed = self.engines[rank].release_held(rid)
            if freed:
                self.drivers[rank].kick()  # a request waiting for those blocks is admitted now
                return freed
        return 0

    def _kv_received(self, rid: str) -> None:
        self._abandon_remote(rid)

    def _abandon_remote(self, rid: str) -> None:
        """The decode side is done with request `rid`'s remote KV: it landed (`_kv_received`), or the request
        ended before it did (aborted, refused). Either way the prefill side is told to free its hold, as
        vLLM's NIXL connector notifies it (after the read, or with no blocks for an aborted request); a
        request whose KV already landed was removed from `_remote` then and is not notified twice."""
        kvp = self._remote.pop(rid, None)
        if not kvp or not kvp.get("remote_host") or not kvp.get("remote_port"):
            return
        task = asyncio.get_running_loop().create_task(self._notify_release(kvp))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _notify_release(self, kvp: dict[str, Any]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=2.0)
        url = f"http://{kvp['remote_host']}:{kvp['remote_port']}/sim/kv/release"
        payload = {k: kvp.get(k) for k in ("remote_engine_id", "remote_block_ids", "remote_request_id")}
        with contextlib.suppress(httpx.HTTPError):  # best effort: the hold times out otherwise
            await self._client.post(url, json=payload)

    # ------------------------------------------------------------ views
    def models_body(self) -> dict[str, Any]:
        """vLLM 0.32's `show_available_models`, dumped whole: the base model's card, then each adapter's in
        load order (`simulator.lora.model_card`); `created` is the time of the call (pydantic's default
        factory), and each card has one `ModelPermission` of vLLM's defaults."""
        card = {
            "id": self.served, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": self.perf.model.name, "parent": None, "max_model_len": self.engine.max_model_len,
            "permission": [model_permission()],
        }  # fmt: skip
        return {"object": "list", "data": [card, *(model_card(m, self.served) for m in self.loras.values())]}

    def state_body(self) -> dict[str, Any]:
        eng = self.engine
        if len(self.engines) == 1:
            return {
                "gpu": self.perf.gpu.name, "model": self.perf.model.name, "served_model_name": self.served,
                "role": self.cfg.role, "tp": self.cfg.tp, "time_scale": self.cfg.time_scale,
                "sim_time_s": self.driver.now(), "num_running": eng.num_running, "num_waiting": eng.num_waiting,
                "num_held": eng.num_held, "kv_usage": eng.kv_usage, "num_gpu_blocks": eng.num_gpu_blocks,
                "block_size": eng.block_size, "max_model_len": eng.max_model_len, "counters": asdict(eng.counters),
            }  # fmt: skip
        engines = [self._engine_state(rank) for rank in range(len(self.engines))]
        counters: dict[str, Any] = {}
        for e in engines:
            for key, value in e["counters"].items():
                if isinstance(value, dict):  # success, by finish reason
                    merged = counters.setdefault(key, {})
                    for reason, n in value.items():
                        merged[reason] = merged.get(reason, 0) + n
                else:
                    counters[key] = counters.get(key, 0) + value
        return {
            "gpu": self.perf.gpu.name, "model": self.perf.model.name, "served_model_name": self.served,
            "role": self.cfg.role, "tp": self.cfg.tp, "time_scale": self.cfg.time_scale,
            "data_parallel_size": len(self.engines), "sim_time_s": max(e["sim_time_s"] for e in engines),
            "num_running": sum(e["num_running"] for e in engines),
            "num_waiting": sum(e["num_waiting"] for e in engines),
            "num_held": sum(e["num_held"] for e in engines),
            "kv_usage": sum(e["kv_usage"] for e in engines) / len(engines),  # engines of equal size
            "num_gpu_blocks": sum(e["num_gpu_blocks"] for e in engines), "block_size": eng.block_size,
            "max_model_len": eng.max_model_len, "counters": counters, "engines": engines,
        }  # fmt: skip

    def _engine_state(self, rank: int) -> dict[str, Any]:
        eng, driver = self.engines[rank], self.drivers[rank]
        return {
            "rank": rank, "sim_time_s": driver.now(), "num_running": eng.num_running,
            "num_waiting": eng.num_waiting, "num_held": eng.num_held, "kv_usage": eng.kv_usage,
            "num_gpu_blocks": eng.num_gpu_blocks, "counters": asdict(eng.counters),
        }  # fmt: skip


async def _disconnected(request: Request) -> None:
    """Returns when the ASGI server reports the client gone (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_worker_app(cfg: WorkerConfig) -> FastAPI:
    """Build one simulated worker (no globals: each app has its own engine, registry and RNG)."""
    rt = WorkerRuntime(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await rt.aclose()

    app = FastAPI(title=f"mosaic simulated vLLM worker ({rt.perf.gpu.name}, {rt.served})", lifespan=lifespan)
    app.state.worker = rt

    async def completions(request: Request) -> Response:
        return await rt.handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await rt.handle(request, chat=True)

    async def responses(request: Request) -> Response:
        return await rt.handle_responses(request)

    async def embeddings(request: Request) -> Response:
        return await rt.handle_embeddings(request)

    async def score(request: Request) -> Response:
        return await rt.handle_scoring(request, rerank=False)

    async def rerank(request: Request) -> Response:
        return await rt.handle_scoring(request, rerank=True)

    async def stored_response(request: Request) -> Response:
        # GET /v1/responses/{id} and POST .../cancel: vLLM always routes them, and with its store off (as
        # here) knows no id: its 404 in OpenAI's shape (a bare `{"detail": "Not Found"}` before)
        err = not_found(request.path_params["response_id"])
        return JSONResponse(err.body(), status_code=err.status)

    async def models(request: Request) -> Response:
        return JSONResponse(rt.models_body())

    async def tokenize(request: Request) -> Response:
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            return JSONResponse(tokenize_body(body, rt.served, rt.engine.max_model_len, rt.loras))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)

    async def detokenize(request: Request) -> Response:
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            vocab = rt.perf.model.vocab_size or VOCAB_SIZE
            return JSONResponse(detokenize_body(body, rt.served, vocab, rt.loras))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if rt.faults.healthy else 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        rt.expire_held()
        return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def state(request: Request) -> Response:
        return JSONResponse(rt.state_body())

    async def faults(request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse(asdict(rt.faults))
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
            known = {f.name for f in fields(FaultConfig)}
            unknown = set(body) - known
            if unknown:
                raise ApiError(400, f"unknown fault fields {sorted(unknown)}; valid: {sorted(known)}")
            new = FaultConfig(**{**asdict(rt.faults), **body})
            new.validate()
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except (TypeError, ValueError) as exc:
            return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)
        rt.faults = new
        return JSONResponse(asdict(new))

    def runtime_lora_route(model: Any, act: Callable[[Any], str]) -> Callable[[Request], Awaitable[Response]]:
        """vLLM's /v1/load_lora_adapter or /v1/unload_lora_adapter: the body validated as `model`, then `act`."""

        async def route(request: Request) -> Response:
            try:
                body = fastapi_body(await request.body(), request.headers.get("content-type"), model)
                text = act(body)
            except ApiError as err:
                return JSONResponse(err.body(), status_code=err.status)
            return Response(text)  # vLLM's Response(content=...): text, no content type

        return route

    load_lora_adapter = runtime_lora_route(LoadLoraAdapterRequest, lambda body: rt.runtime_loras.load(body))
    unload_lora_adapter = runtime_lora_route(
        UnloadLoraAdapterRequest, lambda body: rt.runtime_loras.unload(body)
    )

    async def kv_release(request: Request) -> Response:
        try:
            body = parse_body(await request.body(), request.headers.get("content-type"))
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse({"released_blocks": rt.release_kv(body)})

    # Plain Starlette routes: the handlers parse bodies themselves (vLLM's error shapes), so FastAPI's
    # dependency solving and per-request telemetry lookups would only add per-request cost. Starlette adds
    # HEAD to every GET route; vLLM's FastAPI GET routes (/health, /v1/models) answer HEAD with 405 (`Allow:
    # GET`), so `get_only` takes it off again. Its /metrics is a mounted Prometheus app answering any method.
    # vLLM attaches its LoRA routes only when runtime updating is allowed: otherwise they are unknown paths
    runtime_lora = (
        (("/v1/load_lora_adapter", load_lora_adapter, ["POST"], False),
         ("/v1/unload_lora_adapter", unload_lora_adapter, ["POST"], False))
        if cfg.allow_runtime_lora_updating
        else ()
    )  # fmt: skip
    # the runner's own routes: a pooling server has no generation API (those paths are vLLM's unknown paths)
    runner_routes = (
        (("/v1/completions", completions, ["POST"], False),
         ("/v1/chat/completions", chat_completions, ["POST"], False),
         ("/v1/responses", responses, ["POST"], False),
         ("/v1/responses/{response_id}", stored_response, ["GET"], True),
         ("/v1/responses/{response_id}/cancel", stored_response, ["POST"], False))
        if cfg.runner == "generate"
        else (("/v1/embeddings", embeddings, ["POST"], False),
              *((path, score, ["POST"], False) for path in ("/score", "/v1/score")),
              *((path, rerank, ["POST"], False) for path in ("/rerank", "/v1/rerank", "/v2/rerank")))
    )  # fmt: skip
    for path, endpoint, methods, get_only in (
        *runner_routes,
        ("/v1/models", models, ["GET"], True),
        ("/tokenize", tokenize, ["POST"], False),
        ("/detokenize", detokenize, ["POST"], False),
        ("/health", health, ["GET"], True),
        ("/ping", health, ["GET", "POST"], False),  # vLLM's SageMaker health route: /health's answer
        ("/version", version, ["GET"], True),
        ("/metrics", metrics, ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"], False),
        ("/sim/state", state, ["GET"], False),
        ("/sim/faults", faults, ["GET", "POST"], False),
        ("/sim/kv/release", kv_release, ["POST"], False),
        *runtime_lora,
    ):
        route = Route(path, endpoint, methods=methods, include_in_schema=False)
        if get_only and route.methods is not None:
            route.methods.discard("HEAD")
        app.router.routes.append(route)
    # vLLM's server always adds Starlette's CORS middleware with its --allowed-* defaults: no origin (0.32:
    # "cross-origin browser access is disabled by default"), every method and header, no credentials; so a
    # browser's preflight gets vLLM's 400 "Disallowed CORS origin" from the simulator too
    app.add_middleware(
        CORSMiddleware, allow_origins=[], allow_methods=["*"], allow_headers=["*"], allow_credentials=False
    )
    return app
