"""Tenants: the team a request is accounted to, a metric label and so bounded. It comes
from a request header (``PTE_TENANT_HEADER``) and/or a short hash of the request's API key
(``PTE_TENANT_FROM_API_KEY``), and only values on the allow-list (``PTE_TENANTS``) are kept:
any other value, a malformed one, or none at all is ``other``. With neither source
configured tenants are off and a request has no tenant (None)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from pte_instrument.settings import MAX_TENANT_LEN, OTHER_TENANT, Settings

TENANT_HASH_HEX = 12  # 48 bits of SHA-256: distinct for any realistic set of keys, useless to recover one
# A bearer token longer than this is not hashed: no real API key is, and hashing costs O(length).
MAX_API_KEY_LEN = 4096


def tenant_hash(api_key: str | bytes) -> str:
    """The tenant an API key is accounted to with ``PTE_TENANT_FROM_API_KEY=1``: the first
    ``TENANT_HASH_HEX`` hex digits of its SHA-256 (the key itself is never kept)."""
    raw = api_key.encode("utf-8") if isinstance(api_key, str) else api_key
    return hashlib.sha256(raw).hexdigest()[:TENANT_HASH_HEX]


def bearer_token(authorization: bytes) -> bytes | None:
    """The key of an ``Authorization: Bearer <key>`` header (the scheme in any case, as vLLM
    reads it), None for any other header."""
    scheme, _, token = authorization.partition(b" ")
    return token if scheme.lower() == b"bearer" and token else None


@dataclass(frozen=True)
class TenantPolicy:
    """Which request headers name the tenant, and which tenants are kept."""

    header: bytes | None = None  # lower-case header name, as ASGI gives them
    from_api_key: bool = False
    allowed: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantPolicy:
        header = settings.tenant_header.lower().encode("ascii") if settings.tenant_header else None
        return cls(header, settings.tenant_from_api_key, settings.tenants)

    @property
    def enabled(self) -> bool:
        return self.header is not None or self.from_api_key

    @property
    def untagged(self) -> str | None:
        """The tenant of a request the middleware did not see (no tag): ``other`` when on."""
        return OTHER_TENANT if self.enabled else None

    def resolve(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The tenant of a request with these (ASGI) headers: the tenant header when the
        request carries it, else its API key's hash; ``other`` unless allow-listed; None when
        tenants are off."""
        if not self.enabled:
            return None
        named = authorization = None
        for name, value in headers:
            if name == self.header and named is None:
                named = value
            elif name == b"authorization" and authorization is None:
                authorization = value
        if named is not None:
            return self._kept(named)
        if self.from_api_key and authorization is not None:
            key = bearer_token(authorization)
            if key is not None and len(key) <= MAX_API_KEY_LEN:
                return self._kept(tenant_hash(key))
        return OTHER_TENANT

    def _kept(self, value: bytes | str) -> str:
        """``value`` if it is on the allow-list, else ``other`` (checked for length first: a
        client may send a header of any size)."""
        if len(value) > MAX_TENANT_LEN:
            return OTHER_TENANT
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        return text if text in self.allowed else OTHER_TENANT
