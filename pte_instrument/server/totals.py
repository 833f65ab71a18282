"""Per-model, per-tenant and per-adapter sums over every request the host priced, in the
session store (``MODEL_TOTALS`` of each): added in the writer's transaction, read by the
routes."""

from __future__ import annotations

import sqlite3
from typing import Any

from pte_instrument.server.records import MODEL_TOTALS, RequestRecord, model_totals_row

_ADD_MODEL = (
    f"INSERT INTO model_totals (model, {', '.join(MODEL_TOTALS)}) VALUES (?, {', '.join('?' * len(MODEL_TOTALS))})"
    " ON CONFLICT (model) DO UPDATE SET " + ", ".join(f"{k} = {k} + excluded.{k}" for k in MODEL_TOTALS)
)
_ADD_TENANT = (
    f"INSERT INTO tenant_totals (tenant, {', '.join(MODEL_TOTALS)}) VALUES (?, {', '.join('?' * len(MODEL_TOTALS))})"
    " ON CONFLICT (tenant) DO UPDATE SET " + ", ".join(f"{k} = {k} + excluded.{k}" for k in MODEL_TOTALS)
)
_ADD_LORA = (
    f"INSERT INTO lora_totals (lora_name, model, {', '.join(MODEL_TOTALS)})"
    f" VALUES (?, ?, {', '.join('?' * len(MODEL_TOTALS))}) ON CONFLICT (lora_name) DO UPDATE SET model = excluded.model, "
    + ", ".join(f"{k} = {k} + excluded.{k}" for k in MODEL_TOTALS)
)


def add(db: sqlite3.Connection, r: RequestRecord) -> None:
    """``r``'s sums into its model's row, and its tenant's and adapter's where it has them."""
    row = model_totals_row(r)
    db.execute(_ADD_MODEL, (r.model, *row))
    if r.tenant is not None:  # allow-listed or "other": a bounded set of rows
        db.execute(_ADD_TENANT, (r.tenant, *row))
    if r.lora_name is not None:  # bounded by the adapters the server accounts by name
        db.execute(_ADD_LORA, (r.lora_name, r.model, *row))


def _sums(db: sqlite3.Connection, table: str, key: str) -> dict[str, dict[str, float]]:
    rows = db.execute(f"SELECT {key}, {', '.join(MODEL_TOTALS)} FROM {table}").fetchall()
    return {row[0]: dict(zip(MODEL_TOTALS, row[1:], strict=True)) for row in rows}


def by_model(db: sqlite3.Connection) -> dict[str, dict[str, float]]:
    return _sums(db, "model_totals", "model")


def by_tenant(db: sqlite3.Connection) -> dict[str, dict[str, float]]:
    return _sums(db, "tenant_totals", "tenant")


def by_lora(db: sqlite3.Connection) -> dict[str, dict[str, Any]]:
    rows = db.execute(f"SELECT lora_name, model, {', '.join(MODEL_TOTALS)} FROM lora_totals").fetchall()
    return {row[0]: {"model": row[1], **dict(zip(MODEL_TOTALS, row[2:], strict=True))} for row in rows}
