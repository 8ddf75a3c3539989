"""API keys (Bearer, constant-time compare), the admin key, and per-key token-bucket rate limits.

Keys come from `auth.api_keys` plus the comma-separated environment variable `auth.api_keys_env`
(same for admin keys). With no API keys at all the gateway is **open** (every request allowed) and
`open_warning()` says so at startup; but a named `auth.api_keys_env` that is unset or holds no key is a
config error (fail closed), not an open gateway. Admin endpoints (`/admin/*`) need an admin key; when no admin key
is configured they are open only if the whole gateway is open, and refused (403) otherwise.

Every presented key is compared with every configured key through `hmac.compare_digest` (no early
exit), so response time does not reveal how much of a key matched or which one.

Rate limits are token buckets per key (`limits.rate_limit`): a request bucket of `burst` refilled at
`requests_per_s`, and a token bucket of `tokens_per_min` refilled continuously at tokens_per_min/60 per
second, debited with prompt + reserved output tokens at admission (at most a full bucket, so no request is
refused forever) and settled once its usage is known (`settle`): credited back what it did not use of that
debit, or debited what it used beyond it — its prompt was only estimated (images and audio are not counted
at all, dense text or code is undercounted), or its debit was capped at a full bucket. That extra debit may
take the bucket below zero, down to minus one full bucket, so a key pays for what it used by waiting (its
next request is refused until the bucket has refilled to cover it). An empty bucket → 429 with
Retry-After = deficit / rate.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from dataclasses import dataclass

from server.config import AuthConfig, ConfigError, RateLimitConfig
from server.errors import Cause, GatewayError

OPEN_KEY_ID = "anonymous"


def _env_keys(name: str | None) -> list[str]:
    if not name:
        return []
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


def key_id(key: str) -> str:
    """A short, non-reversible label for a key (metrics, logs, rate-limit buckets): never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


class KeyStore:
    """Configured API and admin keys, as bytes for constant-time comparison."""

    def __init__(self, config: AuthConfig) -> None:
        env = config.api_keys_env
        if env and not _env_keys(env):
            # Fail closed: naming a variable asks for keys, and an unset one (an unexported shell variable, a
            # Secret key missing) would otherwise serve everyone with a warning in the log. ConfigError: exit 2.
            state = "is not set" if env not in os.environ else "holds no keys"
            raise ConfigError(
                f"auth.api_keys_env: environment variable {env} {state}; set it to comma-separated keys, or "
                "remove auth.api_keys_env to serve without API keys"
            )
        api = [*config.api_keys, *_env_keys(env)]
        admin = [*config.admin_keys, *_env_keys(config.admin_keys_env)]
        self._api = [k.encode() for k in dict.fromkeys(api)]
        self._admin = [k.encode() for k in dict.fromkeys(admin)]

    @property
    def open(self) -> bool:
        return not self._api

    def open_warning(self) -> str | None:
        if self._api:
            return None
        return "no API keys configured (auth.api_keys / auth.api_keys_env): the gateway accepts every request"

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key id; `GatewayError(unauthorized)` when keys are configured and none matches."""
        if not self._api:
            return OPEN_KEY_ID
        presented = _bearer(authorization)
        if presented is None or not _matches(presented, self._api):
            raise GatewayError(
                Cause.UNAUTHORIZED, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."
            )
        return key_id(presented.decode(errors="replace"))

    def authenticate_admin(self, authorization: str | None) -> None:
        if not self._admin:
            if self.open:
                return
            raise GatewayError(Cause.FORBIDDEN, "Admin endpoints are disabled: no admin key is configured.")
        presented = _bearer(authorization)
        if presented is None or not _matches(presented, self._admin):
            raise GatewayError(Cause.UNAUTHORIZED, "Incorrect or missing admin key.")


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _matches(presented: bytes, keys: list[bytes]) -> bool:
    found = False
    for key in keys:  # compare against all keys: time does not depend on which one matched
        found |= hmac.compare_digest(presented, key)
    return found


@dataclass(slots=True)
class TokenBucket:
    """Capacity `capacity`, refilled at `rate` per second; `level` may go negative only via `force_take`, down
    to −capacity."""

    capacity: float
    rate: float
    level: float
    updated: float

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if available and return 0; else take nothing and return seconds until it would be."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def force_take(self, amount: float, now: float) -> None:
        """Take `amount` whether or not it is there (a debt for what was already used), down to −capacity."""
        self._refill(now)
        self.level = max(-self.capacity, self.level - amount)


class RateLimiter:
    """Per-key request and token buckets (see module docstring); a no-op when both limits are unset."""

    def __init__(self, config: RateLimitConfig) -> None:
        self._cfg = config
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self._cfg.requests_per_s is not None or self._cfg.tokens_per_min is not None

    def admit(self, key: str, tokens: int, now: float) -> int:
        """Debit one request and `tokens`; `GatewayError` 429 (request or token limit) when a bucket is short.

        Returns the tokens actually debited (at most a full bucket; 0 without a token limit): what `refund`
        may credit back at most. Refunding from the uncapped `tokens` refilled the bucket after every
        request with a huge `max_tokens`, so such requests were never limited."""
        cfg = self._cfg
        req_bucket = None
        if cfg.requests_per_s is not None:
            burst = cfg.burst if cfg.burst is not None else max(1, math.ceil(cfg.requests_per_s))
            req_bucket = self._bucket(self._requests, key, float(burst), cfg.requests_per_s, now)
            wait = req_bucket.take(1.0, now)
            if wait > 0:
                raise GatewayError(
                    Cause.RATE_LIMITED,
                    f"Rate limit reached: {cfg.requests_per_s:g} requests/s for this key.",
                    retry_after_s=wait,
                )
        if cfg.tokens_per_min is not None and tokens > 0:  # a call that costs no tokens (/tokenize) owes none
            bucket = self._bucket(self._tokens, key, cfg.tokens_per_min, cfg.tokens_per_min / 60.0, now)
            # A request larger than the whole bucket can never pass: charge at most a full bucket.
            charged = min(tokens, math.floor(bucket.capacity))
            wait = bucket.take(float(charged), now)
            if wait > 0:
                if req_bucket is not None:
                    req_bucket.give(1.0, now)  # the request was not admitted: refund its request token
                raise GatewayError(
                    Cause.TOKEN_RATE_LIMITED,
                    f"Rate limit reached: {cfg.tokens_per_min:g} tokens/min for this key "
                    f"(this request needs {tokens} tokens).",
                    retry_after_s=wait,
                )
            return charged
        return 0

    def settle(self, key: str, charged: int, used: int, now: float) -> None:
        """Settle a request's token debit with what it used: credit back `charged − used` when it used less,
        debit `used − charged` more when it used more (the bucket may go below zero, to −capacity)."""
        bucket = self._tokens.get(key)
        if bucket is None:
            return
        if used < charged:
            bucket.give(float(charged - used), now)
        elif used > charged:
            bucket.force_take(float(used - charged), now)

    @staticmethod
    def _bucket(
        table: dict[str, TokenBucket], key: str, capacity: float, rate: float, now: float
    ) -> TokenBucket:
        bucket = table.get(key)
        if bucket is None:
            bucket = table[key] = TokenBucket(capacity, rate, capacity, now)
        return bucket
