"""API keys, admin keys and per-key token buckets (pure: time is passed in), and the buckets as the gateway
debits and refunds them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.app import create_app
from server.auth import OPEN_KEY_ID, KeyStore, RateLimiter, TokenBucket, key_id
from server.config import AuthConfig, ConfigError, RateLimitConfig
from server.errors import Cause, GatewayError
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        pytest.param("Bearer sk-one", True, id="first configured key → accepted"),
        pytest.param("bearer sk-env-2", True, id="key from the environment, lower-case scheme → accepted"),
        pytest.param("Bearer sk-on", False, id="a prefix of a key → 401"),
        pytest.param("Basic sk-one", False, id="wrong scheme → 401"),
        pytest.param("Bearer ", False, id="empty token → 401"),
        pytest.param(None, False, id="no header → 401"),
    ],
)
def test_api_keys(header: str | None, ok: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOSAIC_TEST_KEYS", "sk-env-1, sk-env-2")
    keys = KeyStore(AuthConfig(api_keys=["sk-one"], api_keys_env="MOSAIC_TEST_KEYS"))
    if ok:
        assert keys.authenticate(header).startswith("key-")
    else:
        with pytest.raises(GatewayError) as err:
            keys.authenticate(header)
        assert err.value.cause is Cause.UNAUTHORIZED and err.value.status == 401


@pytest.mark.parametrize(("value", "state"), [(None, "is not set"), (" , ", "holds no keys")])
def test_a_named_keys_variable_that_is_unset_or_empty_fails_closed(
    value: str | None, state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Naming a variable asks for keys: unset (not exported, a missing Secret key) or empty it refuses to start
    (exit 2 from `mosaic serve`) instead of serving everyone; api_keys in the file do not excuse it."""
    monkeypatch.delenv("MOSAIC_TEST_KEYS", raising=False)
    if value is not None:
        monkeypatch.setenv("MOSAIC_TEST_KEYS", value)
    with pytest.raises(ConfigError) as err:
        KeyStore(AuthConfig(api_keys=["sk-one"], api_keys_env="MOSAIC_TEST_KEYS"))
    assert str(err.value) == (
        f"auth.api_keys_env: environment variable MOSAIC_TEST_KEYS {state}; set it to comma-separated keys, "
        "or remove auth.api_keys_env to serve without API keys"
    )


def test_key_id_never_contains_the_key() -> None:
    assert "sk-one" not in key_id("sk-one") and key_id("sk-one") == key_id("sk-one") != key_id("sk-two")


def test_open_gateway_warns_and_allows_admin() -> None:
    keys = KeyStore(AuthConfig())
    assert keys.open and keys.open_warning() is not None
    assert keys.authenticate(None) == OPEN_KEY_ID
    keys.authenticate_admin(None)  # open gateway, no admin key: admin open too


@pytest.mark.parametrize(
    ("config", "header", "cause"),
    [
        pytest.param(
            AuthConfig(api_keys=["k"]),
            "Bearer k",
            Cause.FORBIDDEN,
            id="keys but no admin key → admin disabled (403)",
        ),
        pytest.param(
            AuthConfig(api_keys=["k"], admin_keys=["adm"]),
            "Bearer k",
            Cause.UNAUTHORIZED,
            id="an API key is not an admin key → 401",
        ),
        pytest.param(
            AuthConfig(api_keys=["k"], admin_keys=["adm"]), "Bearer adm", None, id="admin key → allowed"
        ),
    ],
)
def test_admin_keys(config: AuthConfig, header: str, cause: Cause | None) -> None:
    keys = KeyStore(config)
    if cause is None:
        keys.authenticate_admin(header)
    else:
        with pytest.raises(GatewayError) as err:
            keys.authenticate_admin(header)
        assert err.value.cause is cause


def test_token_bucket_arithmetic() -> None:
    b = TokenBucket(capacity=10, rate=2, level=10, updated=0.0)
    assert b.take(10, now=0.0) == 0.0  # the whole burst
    assert b.take(1, now=0.0) == pytest.approx(0.5)  # (1 − 0) / 2 per s
    assert b.take(3, now=1.0) == pytest.approx(0.5)  # refilled 2 by t=1, short 1 → 0.5 s
    assert b.take(2, now=1.0) == 0.0
    b.give(100, now=1.0)
    assert b.level == 10  # never above capacity


def test_request_rate_limit_with_retry_after() -> None:
    lim = RateLimiter(RateLimitConfig(requests_per_s=2, burst=2))
    lim.admit("k", 0, now=0.0)
    lim.admit("k", 0, now=0.0)
    with pytest.raises(GatewayError) as err:
        lim.admit("k", 0, now=0.0)
    assert err.value.cause is Cause.RATE_LIMITED and err.value.retry_after_s == pytest.approx(
        0.5
    )  # 1 token at 2/s
    lim.admit("other", 0, now=0.0)  # buckets are per key
    lim.admit("k", 0, now=0.5)


def test_token_rate_limit_refunds_unused_tokens() -> None:
    lim = RateLimiter(RateLimitConfig(tokens_per_min=600))  # 10 tokens/s refill
    lim.admit("k", 500, now=0.0)
    with pytest.raises(GatewayError) as err:
        lim.admit("k", 200, now=0.0)  # 100 left, 200 needed: short 100 → 10 s
    assert err.value.cause is Cause.TOKEN_RATE_LIMITED and err.value.retry_after_s == pytest.approx(10.0)
    lim.settle("k", 500, 50, now=0.0)  # the first request used 50 of its 500
    lim.admit("k", 200, now=0.0)


def test_token_limit_failure_refunds_the_request_token() -> None:
    lim = RateLimiter(RateLimitConfig(requests_per_s=1, burst=1, tokens_per_min=60))  # tokens refill 1/s
    lim.admit("k", 50, now=0.0)  # request bucket 1 → 0; tokens 60 → 10
    with pytest.raises(GatewayError) as err:
        lim.admit("k", 30, now=1.0)  # requests refilled to 1; tokens 11, short 19 → 19 s
    assert err.value.cause is Cause.TOKEN_RATE_LIMITED and err.value.retry_after_s == pytest.approx(19.0)
    lim.admit("k", 5, now=1.0)  # the refused request gave its request token back


def test_request_larger_than_the_bucket_is_charged_a_full_bucket() -> None:
    lim = RateLimiter(RateLimitConfig(tokens_per_min=60))
    lim.admit("k", 10_000, now=0.0)  # min(10000, 60): never refused forever
    with pytest.raises(GatewayError):
        lim.admit("k", 1, now=0.0)


def test_admit_returns_what_it_debited_and_a_refund_never_exceeds_it() -> None:
    lim = RateLimiter(RateLimitConfig(tokens_per_min=1000))
    assert RateLimiter(RateLimitConfig(requests_per_s=5)).admit("k", 500, now=0.0) == 0  # no token limit
    assert lim.admit("k", 300, now=0.0) == 300
    lim.settle("k", 300, 200, now=0.0)  # used 200 of 300: the bucket holds 1000 − 300 + 100 = 800
    charged = lim.admit(
        "k", 1_000_000, now=12.0
    )  # a huge max_tokens is charged a full bucket (refilled by 12 s)
    assert charged == 1000 and lim._tokens["k"].level == 0
    lim.settle("k", charged, 900, now=12.0)  # it used 900: 100 back, not 1,000,000 − 900
    with pytest.raises(GatewayError) as err:
        lim.admit("k", 1_000_000, now=12.0)  # 100 in the bucket, 1000 needed: 900 short at 1000 a minute
    assert err.value.cause is Cause.TOKEN_RATE_LIMITED and err.value.retry_after_s == pytest.approx(54.0)


def test_usage_beyond_the_debit_is_debited_too_down_to_minus_one_bucket() -> None:
    """A request that used more than it was debited (its prompt estimated low, or its debit capped at a full
    bucket) pays the difference: the bucket goes into debt, at most one bucket deep, and the key waits."""
    lim = RateLimiter(RateLimitConfig(tokens_per_min=600))  # 10 tokens/s
    assert lim.admit("k", 100, now=0.0) == 100
    lim.settle("k", 100, 400, now=0.0)  # used 400: 600 − 100 − 300 = 200 left
    assert lim._tokens["k"].level == pytest.approx(200)
    lim.settle("k", 0, 5_000, now=0.0)  # far more than a bucket: the debt stops at −600
    assert lim._tokens["k"].level == pytest.approx(-600)
    with pytest.raises(GatewayError) as err:
        lim.admit("k", 10, now=0.0)
    assert err.value.retry_after_s == pytest.approx(61.0)  # (10 + 600) / 10 per second
    lim.admit("k", 10, now=61.0)
    lim.settle("other", 0, 100, now=0.0)  # a key never admitted has no bucket: nothing to settle


def test_requests_using_more_than_their_estimate_are_limited_by_what_they_use() -> None:
    """Through the gateway: chat requests with an image part are debited their text estimate (images are not
    counted) and use 1,510 tokens each; against 1,000 tokens a minute the first one passes, and the key is
    in debt afterwards, so the next ones are refused (each of the 40 passed before: only the estimate was
    ever debited)."""
    worker = FakeWorker("a", usage={"prompt_tokens": 1500, "completion_tokens": 10, "total_tokens": 1510})
    cfg = config(pool("p", "L4", "mixed", worker), limits={"rate_limit": {"tokens_per_min": 1000}})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}],
        "max_tokens": 10,
    }

    async def go() -> list[int]:
        app = create_app(cfg, transport=FakeFleet(worker).transport)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c,
        ):
            return [(await c.post("/v1/chat/completions", json=body)).status_code for _ in range(5)]

    assert asyncio.run(go()) == [200, 429, 429, 429, 429]
    assert len(worker.seen) == 1


def test_requests_with_a_huge_max_tokens_are_limited_by_what_they_use() -> None:
    """Through the gateway: 900 tokens used a request against 1000 a minute lets one through, not all (the
    refund of reserved − used refilled the bucket after each request, so every one passed)."""
    worker = FakeWorker("a", usage={"prompt_tokens": 500, "completion_tokens": 400, "total_tokens": 900})
    cfg = config(pool("p", "L4", "mixed", worker), limits={"rate_limit": {"tokens_per_min": 1000}})

    async def go() -> list[int]:
        app = create_app(cfg, transport=FakeFleet(worker).transport)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
        ):
            body = {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 100_000}
            return [(await client.post("/v1/completions", json=body)).status_code for _ in range(3)]

    assert asyncio.run(go()) == [200, 429, 429]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "worker, outcome",
    [
        pytest.param(FakeWorker("a", mode="status", status=503), "failed_before_first_byte", id="503"),
        pytest.param(FakeWorker("a", mode="status", status=400), "worker_rejected", id="400"),
    ],
)
def test_a_request_that_generated_nothing_is_refunded_in_full(
    worker: FakeWorker, outcome: str, stream: bool
) -> None:
    """Every worker failed it (503) or the worker refused it (400): its whole debit (prompt + 50,000 reserved
    output tokens of a 100,000-token bucket) comes back. A stream gets these as the worker's error event
    before any token (status 200 to the client): that kept the whole debit, as for a stream cut without
    usage, so a key whose streams kept failing was throttled as if each had generated `max_tokens`."""
    if stream:
        code = worker.status
        worker = FakeWorker("a", mode="error_event", error_code=code)
    cfg = config(pool("p", "L4", "mixed", worker), limits={"rate_limit": {"tokens_per_min": 100_000}})
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50_000,
        "stream": stream,
    }

    async def go() -> tuple[int, dict[str, int], float]:
        app = create_app(cfg, transport=FakeFleet(worker).transport)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
        ):
            status = (await client.post("/v1/chat/completions", json=body)).status_code
            gw = app.state.gateway
            (bucket,) = gw.limiter._tokens.values()
            return status, dict(gw.dispatcher.outcomes), bucket.level

    status, outcomes, level = asyncio.run(go())
    assert status == (200 if stream else worker.status)
    assert outcomes == {outcome: 1}
    assert level > 99_990  # full again but for the refill's rounding; 49,99x when the debit was kept
