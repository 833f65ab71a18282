"""The session store a fleet of replicas shares: a Redis (or Valkey) server, named by
``PTE_SESSION_STORE=redis://…`` or ``rediss://…``. The same ledger as the SQLite store
(``sessions``): the same bounds, the same answers from every replica, writes off the request
path, a batch at a time. Each write is one Lua script, so each is whole, and each request is
applied once whichever replica or retry sends it (its replica, id and finish time are
remembered for ten minutes: at 1,000 requests a second, 600,000 keys of about 100 bytes).

Redis unreachable or slow: nothing waits for it longer than ``PTE_SESSION_STORE_TIMEOUT_S``
(0.25 s by default). The first failure says it in one line and counts it; the store is then
left alone for a back-off (1 s, doubling to 30 s), and a turn's context comes from this
process's latest turns; then it is tried again. The turns and feedback-window observations of
a failed batch, and those made meanwhile, are kept (as many of each as the writer's queue
holds, the oldest lost first, counted) and sent again with the next batch: each turn, and each
batch's observations, is applied once, so what a first try did write is not counted twice.
Sessions due to close are closed a hundred or so per script, so that none holds Redis for long
however many are due at once; a script's sessions are held for its writer until it says it
read them, so that a lost reply loses none of them (they are told closed once).
One Redis server (or a primary), not a cluster: the scripts touch keys they do not declare."""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pte_instrument.failpoints import failpoint
from pte_instrument.faults import log
from pte_instrument.server.records import MODEL_TOTALS, RequestRecord, model_totals_row
from pte_instrument.server.session_store import (
    COUNTED,
    OUTCOME_COUNTS,
    SERVER_ALIVE_S,
    SORT_KEYS,
    SUMMED,
    BatchWriter,
    Commit,
    StoreError,
)
from pte_instrument.server.sessions import SessionLedger, Tail, told_ids, turn_row
from pte_instrument.server.turn_order import PEER_ALIVE_S, WRITER_GONE_S, Watermarks
from pte_instrument.settings import Settings, is_redis_url

TIMEOUT_S = Settings.session_store_timeout_s  # the setting's default: a longer command has failed
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
SEEN_TTL_S = 600  # how long a request id is remembered, so that it is applied once
# Sessions one close script closes at most: a few ms of Redis's time, however many are due.
CLOSE_CHUNK = 128
# How long one batch of the writer goes on closing chunks; the rest close with the next batch,
# so that the turns queued meanwhile are written.
CLOSE_BUDGET_S = 0.5
# How long a close call's sessions are held for the writer that has not read its reply:
# past the longest back-off, so that its next call finds them.
CLOSED_HELD_S = 300
REFUSED = -2  # the add script's turn number for a turn it did not apply (a key of the wrong type)
PREFIX = "pte:"

# The live sessions by each sort key of ``/pte/sessions``: zsets by:<key> the scripts keep, so
# that a page is read in O(log n) rather than by sorting every live session in one command,
# which holds Redis for every replica (0.1 s at 100,000 sessions).
_SORTED = "local SORTED = {" + ", ".join(f"'{k}'" for k in SORT_KEYS) + "}\n"

# Each script first checks that the keys it writes hold what it writes to them (or nothing),
# and the fields it adds to a number the addition takes (or nothing): an error half-way through
# a script keeps what it wrote before it (its request marked applied, its totals added), and a
# key someone else put under the prefix with another type, or a value of its own in a field,
# would make a turn count half, or stop every batch. ``wrong_type`` returns a message naming
# the first key that does not (or false), and the type of each key; ``unaddable`` a message
# naming the field (``whole``: one HINCRBY or INCR adds ``step`` to; else HINCRBYFLOAT), and
# ``unaddable_sums`` the first of a hash's (field, step) pairs, one HMGET. ``cell`` names an
# outcome count's field: <model>\x1f<benchmark>\x1f<count>.
_WRONG_TYPE = """
local function wrong_type(wanted)
  local types = {}
  for i = 1, #wanted, 2 do
    local found = redis.call('TYPE', wanted[i])['ok']
    if found ~= 'none' and found ~= wanted[i + 1] then
      return 'key ' .. wanted[i] .. ' holds a ' .. found .. ', not a ' .. wanted[i + 1], types
    end
    types[wanted[i]] = found
  end
  return false, types
end
local function unaddable(key, field, v, step, whole)
  if not v then return false end
  local ok
  if whole then  -- as Redis reads an integer: no sign but '-', no leading zero, no space
    ok = #v <= 18 and (v == '0' or string.find(v, '^-?[1-9]%d*$') ~= nil)
  else  -- tonumber takes spaces around, Redis none; a sum that is not finite Redis refuses
    local n = not string.find(v, '%s') and tonumber(v)
    ok = n and math.abs(n + step) < math.huge
  end
  if ok then return false end
  local named = field and (' field ' .. string.gsub(field, '\\31', '/')) or ''  -- a count's cell: model/benchmark/count
  return 'key ' .. key .. named .. " holds '" .. string.sub(v, 1, 40) .. "', not " .. (whole and 'an integer' or 'a number')
end
local function unaddable_sums(key, values, whole)
  local fields = {}
  for i = 1, #values, 2 do fields[#fields + 1] = values[i] end
  local found = redis.call('HMGET', key, unpack(fields))
  for j = 1, #fields do
    local bad = unaddable(key, fields[j], found[j], tonumber(values[2 * j]), whole)
    if bad then return bad end
  end
  return false
end
local function cell(model, benchmark, name) return model .. '\\31' .. benchmark .. '\\31' .. name end
"""

# KEYS: none (standalone Redis). ARGV: prefix, now, max_turns, seen_ttl, the turn (JSON).
# Returns {turn number (0: no session; -1: applied before; -2: not applied), opened, rows
# dropped}, and for -2 why (a key of the wrong type, a field that holds no number). The
# numbers are checked where the turn adds to them: one HMGET per hash (none for a new one),
# a GET of the activity counter.
_ADD = (
    _WRONG_TYPE
    + _SORTED
    + """
local p, now, max_turns = ARGV[1], ARGV[2], tonumber(ARGV[3])
local r = cjson.decode(ARGV[5])
local wanted = {p .. 'seen:' .. r.request_id, 'string', p .. 'totals:model:' .. r.model, 'hash', p .. 'models', 'set'}
if r.tenant then
  for _, k in ipairs({p .. 'totals:tenant:' .. r.tenant, 'hash', p .. 'tenants', 'set'}) do table.insert(wanted, k) end
end
if r.lora then
  for _, k in ipairs({p .. 'totals:lora:' .. r.lora, 'hash', p .. 'loras', 'set'}) do table.insert(wanted, k) end
end
if r.session_id then
  for _, k in ipairs({p .. 's:' .. r.session_id, 'hash', p .. 't:' .. r.session_id, 'list', p .. 'counters', 'hash',
                      p .. 'touched', 'string', p .. 'live', 'zset', p .. 'seen', 'zset'}) do
    table.insert(wanted, k)
  end
  for _, k in ipairs(SORTED) do table.insert(wanted, p .. 'by:' .. k); table.insert(wanted, 'zset') end
end
local wrong, types = wrong_type(wanted)
if wrong then return {-2, 0, 0, wrong} end
if types[p .. 'seen:' .. r.request_id] ~= 'none' then return {-1, 0, 0} end
local function sums(key, values)
  return types[key] == 'hash' and unaddable_sums(key, values)
end
wrong = sums(p .. 'totals:model:' .. r.model, r.totals)
  or (r.tenant and sums(p .. 'totals:tenant:' .. r.tenant, r.totals))
  or (r.lora and sums(p .. 'totals:lora:' .. r.lora, r.totals))
if r.session_id and not wrong then
  local s, t, counters, touched = p .. 's:' .. r.session_id, p .. 't:' .. r.session_id, p .. 'counters', p .. 'touched'
  local n, dropped = false, false
  if types[s] == 'hash' then
    n, dropped = unpack(redis.call('HMGET', s, 'n_turns', 'turns_dropped'))
    wrong = unaddable(s, 'n_turns', n, 1, true) or unaddable_sums(s, r.sums)
  end
  local opens = (tonumber(n) or 0) == 0  -- the first turn sets turns_dropped before it adds to it
  local drops = (types[t] == 'list' and redis.call('LLEN', t) or 0) + 1 - max_turns
  if not wrong and drops > 0 and not opens then wrong = unaddable(s, 'turns_dropped', dropped, drops, true) end
  if not wrong and types[counters] == 'hash' and (opens or drops > 0) then
    local o, d = unpack(redis.call('HMGET', counters, 'sessions_opened', 'turns_dropped'))
    wrong = (opens and unaddable(counters, 'sessions_opened', o, 1, true))
      or (drops > 0 and unaddable(counters, 'turns_dropped', d, drops, true))
  end
  if not wrong and types[touched] == 'string' then
    wrong = unaddable(touched, nil, redis.call('GET', touched), 1, true)
  end
end
if wrong then return {-2, 0, 0, wrong} end
redis.call('SET', p .. 'seen:' .. r.request_id, 1, 'EX', ARGV[4])
local function add(key, values)  -- the fields' sums after it, by name
  local after = {}
  for i = 1, #values, 2 do after[values[i]] = redis.call('HINCRBYFLOAT', key, values[i], values[i + 1]) end
  return after
end
add(p .. 'totals:model:' .. r.model, r.totals)
redis.call('SADD', p .. 'models', r.model)
if r.tenant then
  add(p .. 'totals:tenant:' .. r.tenant, r.totals)
  redis.call('SADD', p .. 'tenants', r.tenant)
end
if r.lora then
  add(p .. 'totals:lora:' .. r.lora, r.totals)
  redis.call('HSET', p .. 'totals:lora:' .. r.lora, 'model', r.model)
  redis.call('SADD', p .. 'loras', r.lora)
end
if not r.session_id then return {0, 0, 0} end
local s, t = p .. 's:' .. r.session_id, p .. 't:' .. r.session_id
local seq = redis.call('HINCRBY', s, 'n_turns', 1)
if seq == 1 then redis.call('HSET', s, 'model', r.model, 'first_seen', now, 'turns_dropped', 0) end
redis.call('HSET', s, 'last_seen', now, 'last_finished_at', r.finished_at, 'last_replica', r.replica)
if r.last_prompt + r.last_output > 0 then
  redis.call('HSET', s, 'last_prompt', r.last_prompt, 'last_output', r.last_output)
elseif seq == 1 then
  redis.call('HSET', s, 'last_prompt', 0, 'last_output', 0)
end
local after = add(s, r.sums)
for _, k in ipairs(SORTED) do
  redis.call('ZADD', p .. 'by:' .. k, after[k] or redis.call('HGET', s, k) or 0, r.session_id)
end
-- the row numbered by the store: its place among the session's turns as they landed
local n = redis.call('RPUSH', t, '{"turn":' .. seq .. ',' .. string.sub(r.row, 2))
local dropped = 0
if n > max_turns then
  dropped = n - max_turns
  redis.call('LTRIM', t, dropped, -1)
  redis.call('HINCRBY', s, 'turns_dropped', dropped)
  redis.call('HINCRBY', p .. 'counters', 'turns_dropped', dropped)
end
redis.call('ZADD', p .. 'live', redis.call('INCR', p .. 'touched'), r.session_id)
redis.call('ZADD', p .. 'seen', now, r.session_id)
if seq == 1 then redis.call('HINCRBY', p .. 'counters', 'sessions_opened', 1) end
return {seq, seq == 1 and 1 or 0, dropped}
"""
)

# ARGV: prefix, idle cut-off (last seen before it), max live sessions, chunk, the writer's id,
# this call's id, the id of the writer's latest call whose reply it read, held_ttl. Closes at
# most ``chunk`` sessions, so that no call holds Redis for long. What a call closed is held
# under closing:<writer> until the writer's next call says it read that reply; one that does
# not gets it again, in the chunk. Returns {more to close (0/1), live count, the closed
# sessions as JSON: [id, reason, [field, value, …]] each; JSON is much quicker to read, why a
# host-wide count of them was left out ('' for none)}: a counter holding another writer's
# value is left as it is, and the sessions close all the same.
_CLOSE = (
    _WRONG_TYPE
    + _SORTED
    + """
local p, cutoff, max_live, chunk = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local held = p .. 'closing:' .. ARGV[5]
local closed = {}
local before = redis.call('HMGET', held, 'call', 'closed')
if before[1] and before[1] ~= ARGV[7] then closed = cjson.decode(before[2]) end
local wanted = {held, 'hash', p .. 'live', 'zset', p .. 'seen', 'zset', p .. 'counters', 'hash'}
for _, k in ipairs(SORTED) do table.insert(wanted, p .. 'by:' .. k); table.insert(wanted, 'zset') end
local wrong, types = wrong_type(wanted)
if wrong then return redis.error_reply(wrong) end
local uncounted, counter = '', {}
if types[p .. 'counters'] == 'hash' then
  local found = redis.call('HMGET', p .. 'counters', 'sessions_expired', 'sessions_evicted')
  for i, name in ipairs({'sessions_expired', 'sessions_evicted'}) do
    local bad = unaddable(p .. 'counters', name, found[i], 0, true)
    if bad then uncounted = bad else counter[name] = true end
  end
else
  counter = {sessions_expired = true, sessions_evicted = true}
end
local ids, counts = {}, {idle = 0, evicted = 0}  -- this call's: the index and counters at the end
local function close(sid, reason)
  -- someone else's key where the session's was: closed without its sums, the key left alone
  local s, t = p .. 's:' .. sid, p .. 't:' .. sid
  local fields = redis.pcall('HGETALL', s)
  if fields.err then fields = {} else redis.call('DEL', s) end
  if redis.call('TYPE', t)['ok'] == 'list' then redis.call('DEL', t) end
  redis.call('ZREM', p .. 'live', sid)
  redis.call('ZREM', p .. 'seen', sid)
  table.insert(ids, sid)
  counts[reason] = counts[reason] + 1
  table.insert(closed, {sid, reason, fields})
end
if chunk > #closed then
  local idle = redis.call('ZRANGEBYSCORE', p .. 'seen', '-inf', '(' .. cutoff, 'LIMIT', 0, chunk - #closed)
  for _, sid in ipairs(idle) do close(sid, 'idle') end
end
local over = redis.call('ZCARD', p .. 'live') - max_live
if over > 0 and chunk > #closed then
  for _, sid in ipairs(redis.call('ZRANGE', p .. 'live', 0, math.min(over, chunk - #closed) - 1)) do
    close(sid, 'evicted')
  end
end
if #ids > 0 then
  for _, k in ipairs(SORTED) do redis.call('ZREM', p .. 'by:' .. k, unpack(ids)) end
  if counter.sessions_expired then redis.call('HINCRBY', p .. 'counters', 'sessions_expired', counts.idle) end
  if counter.sessions_evicted then redis.call('HINCRBY', p .. 'counters', 'sessions_evicted', counts.evicted) end
else
  uncounted = ''
end
local json = '[]'
redis.call('DEL', held)
if #closed > 0 then
  json = cjson.encode(closed)
  redis.call('HSET', held, 'call', ARGV[6], 'closed', json)
  redis.call('EXPIRE', held, ARGV[8])
end
local live = redis.call('ZCARD', p .. 'live')
local more = live > max_live or redis.call('ZCOUNT', p .. 'seen', '-inf', '(' .. cutoff) > 0
return {more and 1 or 0, live, json, uncounted}
"""
)

# ARGV: prefix, window, seen_ttl, the group's id, then (request id, session id or '', model,
# benchmark, output tokens, truncated) per finished request; a group is applied once. The
# window's requests: hash r:<id> and zset recent (by seq); a session's: zset rs:<session>.
# Counts per cell: hash outcomes, fields <model>\\x1f<benchmark>\\x1f<count>. Returns 0, or
# why the group was not applied (a key of the wrong type, a count that holds no integer). The
# index of a session a request leaves (``rs:``) is someone else's where it holds another type:
# left alone.
_OBSERVE = (
    _WRONG_TYPE
    + """
local p, window = ARGV[1], tonumber(ARGV[2])
local wanted = {p .. 'obs:' .. ARGV[4], 'string', p .. 'outcomes', 'hash', p .. 'recent', 'zset',
                p .. 'recent:seq', 'string'}
for i = 5, #ARGV, 6 do
  table.insert(wanted, p .. 'r:' .. ARGV[i]); table.insert(wanted, 'hash')
  if ARGV[i + 1] ~= '' then table.insert(wanted, p .. 'rs:' .. ARGV[i + 1]); table.insert(wanted, 'zset') end
end
local wrong, types = wrong_type(wanted)
if wrong then return wrong end
if types[p .. 'obs:' .. ARGV[4]] ~= 'none' then return 0 end
if types[p .. 'recent:seq'] == 'string' then
  wrong = unaddable(p .. 'recent:seq', nil, redis.call('GET', p .. 'recent:seq'), 1, true)
  if wrong then return wrong end
end
if types[p .. 'outcomes'] == 'hash' then
  local counts = {}
  for i = 5, #ARGV, 6 do
    for _, name in ipairs({'requests', 'truncated', 'output_tokens'}) do
      table.insert(counts, cell(ARGV[i + 2], ARGV[i + 3], name)); table.insert(counts, 0)
    end
  end
  wrong = unaddable_sums(p .. 'outcomes', counts, true)
  if wrong then return wrong end
end
redis.call('SET', p .. 'obs:' .. ARGV[4], 1, 'EX', ARGV[3])
local seq
local function count(model, benchmark, name, n)
  redis.call('HINCRBY', p .. 'outcomes', cell(model, benchmark, name), n)
end
for i = 5, #ARGV, 6 do
  local rid, sid, model, benchmark = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local tokens, truncated = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
  seq = redis.call('INCR', p .. 'recent:seq')
  local k = p .. 'r:' .. rid
  local before = redis.call('HGET', k, 'session_id')
  if before and before ~= '' then redis.pcall('ZREM', p .. 'rs:' .. before, rid) end
  redis.call('HSET', k, 'seq', seq, 'model', model, 'benchmark', benchmark, 'output_tokens', tokens,
             'truncated', truncated, 'session_id', sid, 'labeled', 0)
  redis.call('ZADD', p .. 'recent', seq, rid)
  if sid ~= '' then redis.call('ZADD', p .. 'rs:' .. sid, seq, rid) end
  count(model, benchmark, 'requests', 1)
  count(model, benchmark, 'truncated', truncated)
  count(model, benchmark, 'output_tokens', tokens)
end
if seq then
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', p .. 'recent', '-inf', seq - window)) do
    local k = p .. 'r:' .. rid
    local sid = redis.pcall('HGET', k, 'session_id')
    if type(sid) ~= 'table' then  -- an error: someone else's key of another type, left alone
      if sid and sid ~= '' then redis.pcall('ZREM', p .. 'rs:' .. sid, rid) end
      redis.call('DEL', k)
    end
  end
  redis.call('ZREMRANGEBYSCORE', p .. 'recent', '-inf', seq - window)
end
return 0
"""
)

# ARGV: prefix, correct (0/1), session id ('' for none), then the request ids (spellings of
# one id). Returns JSON: null (none in the window), [] (already labeled), the outcome, or
# {"refused": why} where a key holds another type or a count no integer (nothing applied).
_LABEL = (
    _WRONG_TYPE
    + """
local p, correct, sid = ARGV[1], ARGV[2] == '1', ARGV[3]
local outcomes = p .. 'outcomes'
local wanted = {outcomes, 'hash'}
if #ARGV > 3 then
  for i = 4, #ARGV do table.insert(wanted, p .. 'r:' .. ARGV[i]); table.insert(wanted, 'hash') end
else
  wanted = {outcomes, 'hash', p .. 'rs:' .. sid, 'zset'}
end
local wrong, types = wrong_type(wanted)
local function refused(why) return cjson.encode({refused = why}) end
if wrong then return refused(wrong) end
local rows = {}
if #ARGV > 3 then
  for i = 4, #ARGV do
    if types[p .. 'r:' .. ARGV[i]] == 'hash' then rows = {ARGV[i]}; break end
  end
else  -- a session's requests whose hash another writer removed are no longer in the window
  for _, rid in ipairs(redis.call('ZRANGE', p .. 'rs:' .. sid, 0, -1)) do
    local found = redis.call('TYPE', p .. 'r:' .. rid)['ok']
    if found == 'hash' then table.insert(rows, rid)
    elseif found ~= 'none' then return refused('key ' .. p .. 'r:' .. rid .. ' holds a ' .. found .. ', not a hash') end
  end
end
if #rows == 0 then return 'null' end
local tokens, labeled = 0, false
for _, rid in ipairs(rows) do
  local k = p .. 'r:' .. rid
  local n, flag = unpack(redis.call('HMGET', k, 'output_tokens', 'labeled'))
  wrong = unaddable(k, 'output_tokens', n or '', 0, true)
  if wrong then return refused(wrong) end
  tokens = tokens + tonumber(n)
  if flag == '1' then labeled = true end
end
if labeled then return '[]' end
local first, last = p .. 'r:' .. rows[1], p .. 'r:' .. rows[#rows]
local model, benchmark = redis.call('HGET', first, 'model'), redis.call('HGET', first, 'benchmark')
if not model or not benchmark then return refused('key ' .. first .. ' holds no model or benchmark') end
local truncated = redis.call('HGET', last, 'truncated') == '1'
correct = correct and not truncated
local counts = {cell(model, benchmark, 'labeled'), 1, cell(model, benchmark, 'labeled_truncated'), truncated and 1 or 0,
                cell(model, benchmark, 'labeled_output_tokens'), tokens, cell(model, benchmark, 'correct'), correct and 1 or 0}
wrong = types[outcomes] == 'hash' and unaddable_sums(outcomes, counts, true)
if wrong then return refused(wrong) end
for i = 1, #counts, 2 do redis.call('HINCRBY', outcomes, counts[i], counts[i + 1]) end
for _, rid in ipairs(rows) do redis.call('HSET', p .. 'r:' .. rid, 'labeled', 1) end
return cjson.encode({model = model, benchmark = benchmark, requests = #rows, output_tokens = tokens,
                     truncated = truncated, correct = correct})
"""
)


def shown_url(url: str) -> str:
    """The store's URL for a log line: without its password, and a byte of the environment
    that is not UTF-8 (a lone surrogate to Python) escaped, which a strict log writer refuses."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        url = urlunsplit(parts._replace(netloc=netloc))
    return url.encode("utf-8", "backslashreplace").decode("utf-8")


def number(text: str) -> int | float:
    """A number Redis stored: an int when it is whole, as the SQLite store answers."""
    try:
        return int(text)
    except ValueError:
        f = float(text)
        return int(f) if f.is_integer() and abs(f) < 2**53 else f


def readable(text: str | None, default: int | float | None = 0) -> int | float | None:
    """A number for a reader: ``default`` where the field is missing, None where another
    writer left something that is no finite number (shown as unknown, not guessed)."""
    if text is None:
        return default
    try:
        x = number(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _published(value: str) -> tuple[float, float] | None:
    """A writer's entry of the writers' hash: its turns' watermark and when it published it;
    None where another writer left something else there."""
    parts = [readable(x, None) for x in value.split()]
    if len(parts) != 2 or parts[0] is None or parts[1] is None:
        return None
    return float(parts[0]), float(parts[1])


class RedisStore(BatchWriter):
    """One process's use of the Redis store: a client for reads (``reading``: raises
    :class:`StoreError` while the store is left alone), and the batch writer."""

    def __init__(
        self,
        url: str,
        commit: Commit,
        on_error: Callable[[Exception], None],
        server_id: str,
        max_queued: int,
        prefix: str = PREFIX,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        super().__init__(commit, on_error, server_id, max_queued)
        try:
            self.path = shown_url(url)
        except ValueError as e:  # no URL at all: its part after the scheme may hold a password
            self.path = url.partition("://")[0] + "://…"
            raise StoreError(f"PTE_SESSION_STORE {self.path} is not a usable Redis URL: {e}") from None
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise StoreError(
                f"the session store {self.path} is a Redis server, and the redis client is not installed "
                "(pip install 'pte-instrument[redis]')"
            ) from None
        self.prefix = prefix
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # the back-off below is the only retry
                decode_responses=True,
            )
            # What from_url leaves to the first command, which would raise it on every read and
            # write: a connection made of the URL's options (one it does not know is a
            # TypeError, a value it does not take a RedisError) and the host's name as DNS
            # takes it (UnicodeError, a ValueError).
            pool = self.client.connection_pool
            pool.connection_class(**pool.connection_kwargs)
            if isinstance(host := pool.connection_kwargs.get("host"), str):
                host.encode("idna")
        except (ValueError, TypeError, redis.RedisError) as e:
            raise StoreError(f"PTE_SESSION_STORE {self.path} is not a usable Redis URL: {e}") from None
        self.scripts = {
            name: self.client.register_script(src)
            for name, src in (("add", _ADD), ("close", _CLOSE), ("observe", _OBSERVE), ("label", _LABEL))
        }
        self._errors = (redis.RedisError, OSError)
        # The id of the latest close call whose reply the writer read: its sessions were told
        # closed, and the store need not send them again.
        self.closing_read = ""
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0

    @property
    def available(self) -> bool:
        """False while the store is left alone after a failure."""
        return time.monotonic() >= self._down_until

    @contextlib.contextmanager
    def reading(self, write: bool = False) -> Iterator[Any]:
        """The client, for one read or write; a failure is a :class:`StoreError`, and starts
        (or lengthens) the back-off. Only a write that answers ends it: a Redis that refuses
        writes (out of memory, a read-only replica) still answers reads."""
        if not self.available:
            raise StoreError(f"session store {self.path} is unreachable; tried again shortly")
        try:
            yield self.client
        except self._errors as e:
            if not _value_refused(e):  # one key or value someone else put there: the store answers
                self._failed(e)
            raise StoreError(f"session store {self.path}: {type(e).__name__}: {e}") from None
        if not write:
            return
        with self._lock:
            if self._backoff:
                log.warning("pte-instrument: session store %s is reachable again", self.path)
            self._backoff = 0.0

    def _failed(self, e: Exception) -> None:
        with self._lock:
            first = self._backoff == 0.0
            self._backoff = FIRST_BACKOFF_S if first else min(2 * self._backoff, MAX_BACKOFF_S)
            self._down_until = time.monotonic() + self._backoff
        if first:
            log.error(
                "pte-instrument: session store %s failed (%s: %s); serving goes on, what it does not "
                "take is kept and written once it answers (what is lost is counted in "
                'pte_plugin_faults_total{stage="sessions"}); it is tried again after %g s, then with '
                "a back-off up to %g s",
                self.path,
                type(e).__name__,
                e,
                FIRST_BACKOFF_S,
                MAX_BACKOFF_S,
            )

    def close(self) -> None:
        self.stop_writer()
        with contextlib.suppress(Exception):
            self.client.close()

    def _connection(self, conn: Any) -> Any:
        return self

    def _release(self, conn: Any) -> None:
        with contextlib.suppress(Exception), self.reading(write=True) as r:
            r.zrem(self.prefix + "servers", self.server_id)
            r.hdel(self.prefix + "writers", self.writer_id)
            r.hdel(self.prefix + "writers:requests", self.writer_id)

    def _publish(self, pipe: Any, watermarks: Watermarks) -> None:
        """This writer's watermarks (``turn_order``: the turns' beside the time it published,
        as a release before the requests' wrote it), and how many writers published lately."""
        now = time.time()
        pipe.hset(self.prefix + "writers:requests", self.writer_id, repr(watermarks.requests))
        pipe.hset(self.prefix + "writers", self.writer_id, f"{watermarks.turns!r} {now!r}")
        pipe.hvals(self.prefix + "writers")

    def _peers_published(self, values: list[str]) -> None:
        now = time.time()
        alive = [p for v in values if (p := _published(v)) is not None and now - p[1] < PEER_ALIVE_S]
        self.with_peers(len(alive) > 1)

    def beat(self, watermarks: Watermarks) -> None:
        """Publish this writer's watermarks, with nothing else to write."""
        with self.reading(write=True) as r:
            pipe = r.pipeline(transaction=False)
            self._publish(pipe, watermarks)
            self._peers_published(pipe.execute()[-1])

    def peer_watermark(self, every_request: bool = False) -> float:
        """The earliest turns' (``every_request``: requests') watermark of the other writers
        that published lately (inf: none; a writer of an older release publishes only the
        turns'); the entries of writers gone for long are dropped."""
        with self.reading() as r:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(self.prefix + "writers")
            pipe.hgetall(self.prefix + "writers:requests")
            found, requests = pipe.execute()
            now, earliest, gone = time.time(), math.inf, []
            for writer, value in found.items():
                if (published := _published(value)) is None:  # no writer's: passed over
                    continue
                watermark, last_seen = published
                if now - last_seen > WRITER_GONE_S:
                    gone.append(writer)
                elif writer != self.writer_id and now - last_seen < PEER_ALIVE_S:
                    if every_request and (of_requests := readable(requests.get(writer), None)) is not None:
                        watermark = of_requests
                    earliest = min(earliest, watermark)
            if gone:
                r.hdel(self.prefix + "writers", *gone)
                r.hdel(self.prefix + "writers:requests", *gone)
        return earliest

    def other_servers(self) -> list[str]:
        with self.reading() as r:
            ids = r.zrangebyscore(self.prefix + "servers", time.time() - SERVER_ALIVE_S, "+inf")
        return sorted(i for i in ids if i != self.server_id)

    # --- the writer's batch: one pipeline ---

    def commit_batch(
        self,
        adds: list[tuple[RequestRecord, Any]],
        observed: list[tuple[str, list[tuple[Any, ...]]]],
        now: float,
        idle_before: float,
        limits: tuple[int, int, int],
        watermarks: Watermarks,
    ) -> tuple[list[list[Any]], list[Any], Closing]:
        """The batch's turns (each with its session's tail), groups of finished requests for
        the feedback window (each group applied once, by its id), then a first chunk of the
        sessions to close (``close_chunk``), in one round trip. ``limits``: max turns per
        session, the feedback window, max live sessions; ``watermarks``: this writer's, as of
        the batch (``turn_order``). Returns each turn's (number, opened, rows dropped; -2 and
        why for one not applied), each group's 0 (or why it was not applied), and the chunk."""
        max_turns, window, max_live = limits
        with self.reading(write=True) as r:
            pipe = r.pipeline(transaction=False)
            for record, tail in adds:
                payload = json.dumps(_turn(record, tail))
                self.scripts["add"](args=[self.prefix, now, max_turns, SEEN_TTL_S, payload], client=pipe)
            for group, requests in observed:
                args: list[Any] = [self.prefix, window, SEEN_TTL_S, group]
                for rid, sid, model, benchmark, tokens, truncated in requests:
                    args += [rid, sid or "", model, benchmark, tokens, truncated]
                self.scripts["observe"](args=args, client=pipe)
            call, args = self._close_args(idle_before, max_live)
            self.scripts["close"](args=args, client=pipe)
            pipe.zadd(self.prefix + "servers", {self.server_id: time.time()})
            self._publish(pipe, watermarks)
            results = pipe.execute()
        self._peers_published(results[-1])
        n = len(adds)
        m = n + len(observed)
        return results[:n], results[n:m], _closing(call, results[m])

    def close_chunk(self, idle_before: float, max_live: int) -> Closing:
        """Close at most ``CLOSE_CHUNK`` sessions: those last seen before ``idle_before``, then
        the least recently active past ``max_live``. The sessions of the writer's latest call,
        if its reply was not read (``closing_read``), come again, first."""
        call, args = self._close_args(idle_before, max_live)
        with self.reading(write=True) as r:
            return _closing(call, self.scripts["close"](args=args, client=r))

    def _close_args(self, idle_before: float, max_live: int) -> tuple[str, list[Any]]:
        call = uuid.uuid4().hex
        args = [self.prefix, idle_before, max_live, CLOSE_CHUNK, self.writer_id, call, self.closing_read]
        return call, [*args, CLOSED_HELD_S]

    def label(self, correct: bool, request_ids: list[str], session_id: str | None) -> Any:
        with self.reading(write=True) as r:
            args = [self.prefix, int(bool(correct)), session_id or "", *request_ids]
            answer = json.loads(self.scripts["label"](args=args, client=r))
        if isinstance(answer, dict) and "refused" in answer:
            raise StoreError(f"session store {self.path}: feedback not applied: {answer['refused']}")
        return answer

    # --- reads ---

    def tail(self, session_id: str) -> tuple[Any, ...] | None:
        return self.tails([session_id])[0]

    def tails(self, session_ids: list[str]) -> list[tuple[Any, ...] | None]:
        """Each session's (turns, last prompt, last output, last finished at, last replica), or
        None where it is not live: one round trip."""
        with self.reading() as r:
            pipe = r.pipeline(transaction=False)
            for sid in session_ids:
                pipe.hmget(self.prefix + "s:" + sid, _TAIL)
            rows = _answers(pipe.execute(raise_on_error=False))
        tails: list[tuple[Any, ...] | None] = []
        for sid, row in zip(session_ids, rows, strict=True):
            try:
                tails.append(None if row is None or row[0] is None else _tail(*row))
            except ValueError:  # another writer's value: the turn is priced without it, counted
                fields = dict(zip(_TAIL, row, strict=True))
                raise StoreError(
                    f"session store {self.path}: key {self.prefix}s:{sid} holds {fields}, not a session's numbers"
                ) from None
        return tails

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self.reading() as r:
            pipe = r.pipeline(transaction=True)
            pipe.hgetall(self.prefix + "s:" + session_id)
            pipe.lrange(self.prefix + "t:" + session_id, 0, -1)
            fields, rows = _answers(pipe.execute(raise_on_error=False))
        if not fields or rows is None:
            return None
        return {
            **session_summary(session_id, fields),
            "turn_rows": [t for t in map(_turn_row, rows) if t is not None],
        }

    def top(self, limit: int, offset: int, key: str) -> tuple[int, list[dict[str, Any]]]:
        live, index = self.prefix + "live", self.prefix + "by:" + key
        with self.reading() as r:
            total = r.zcard(live)
            # A replica of an older release, in a fleet upgraded one at a time, adds sessions to
            # no index and closes them without taking them out: an index of another size, or a
            # page that meets a closed session, is not trusted (the closed ones leave it), and
            # the page is sorted whole. Ties: the ids descending, as SORT. A live session whose
            # hash someone else replaced with another type is left out of the page.
            indexed = key in SORT_KEYS and r.zcard(index) == total
            ids = r.zrevrange(index, offset, offset + limit - 1) if indexed else []
            rows = self._sessions(r, ids) if indexed else None
            closed = [sid for sid, f in zip(ids, rows or (), strict=True) if f == {}]
            if rows is None or closed:
                if closed:
                    r.zrem(index, *closed)
                ids = r.sort(live, by=f"{self.prefix}s:*->{key}", start=offset, num=limit, desc=True)
                rows = self._sessions(r, ids)
        return total, [session_summary(sid, f) for sid, f in zip(ids, rows, strict=True) if f]

    def _sessions(self, r: Any, ids: list[str]) -> list[Any]:
        pipe = r.pipeline(transaction=False)
        for sid in ids:
            pipe.hgetall(self.prefix + "s:" + sid)
        return _answers(pipe.execute(raise_on_error=False))

    def totals(self, kind: str) -> dict[str, dict[str, Any]]:
        members = {"model": "models", "tenant": "tenants", "lora": "loras"}[kind]
        with self.reading() as r:
            names = sorted(r.smembers(self.prefix + members))
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(f"{self.prefix}totals:{kind}:{name}")
            rows = _answers(pipe.execute(raise_on_error=False))
        out: dict[str, dict[str, Any]] = {}
        for name, fields in zip(names, rows, strict=True):
            if fields is None:  # a key of another type someone else put there
                continue
            sums: dict[str, Any] = {k: readable(fields.get(k)) for k in MODEL_TOTALS}
            out[name] = {"model": fields.get("model", ""), **sums} if kind == "lora" else sums
        return out

    def outcomes(self) -> dict[tuple[str, str], dict[str, int]]:
        with self.reading() as r:
            fields = r.hgetall(self.prefix + "outcomes")
        out: dict[tuple[str, str], dict[str, int]] = {}
        unreadable: set[tuple[str, str]] = set()  # a cell whose ratios cannot be computed
        for name, value in fields.items():
            parts = name.split("\x1f")
            if len(parts) != 3 or parts[2] not in OUTCOME_COUNTS:  # another writer's field
                continue
            model, benchmark, count = parts
            n = readable(value)
            if not isinstance(n, int) or n < 0:
                unreadable.add((model, benchmark))
                continue
            out.setdefault((model, benchmark), dict.fromkeys(OUTCOME_COUNTS, 0))[count] = n
        return {cell: counts for cell, counts in out.items() if cell not in unreadable}

    def host_stats(self) -> dict[str, int | None]:
        with self.reading() as r:
            counts = r.hgetall(self.prefix + "counters")
            live = r.zcard(self.prefix + "live")
        return {"live": live, **{k: readable(counts.get(k)) for k in COUNTED}}

    def live(self) -> int:
        with self.reading() as r:
            return int(r.zcard(self.prefix + "live"))


@dataclass(frozen=True)
class Closing:
    """What one close call did: the sessions it closed (summary, reason), the live count after
    it, and whether more are due."""

    call: str  # its id: once its reply is read (``RedisStore.closing_read``), it is not sent again
    closed: list[tuple[dict[str, Any], str]]
    live: int
    more: bool
    uncounted: str = ""  # why the host-wide count of the sessions closed was left out ('': it was not)


def _closing(call: str, reply: list[Any]) -> Closing:
    more, live, closed, uncounted = reply
    summaries = [
        # an empty list of fields comes back from Lua as {}
        (session_summary(sid, dict(zip(f[::2], f[1::2], strict=True)) if f else {}), reason)
        for sid, reason, f in json.loads(closed)
    ]
    return Closing(call, summaries, int(live), bool(more), uncounted)


def _wrong_type(e: Exception) -> bool:
    """Redis refused a command on a key holding another type than the command's."""
    return type(e).__name__ == "ResponseError" and "WRONGTYPE" in str(e)


# Redis's words for a command refused over a value it met (another writer's text where a
# number goes): the store itself answers.
_VALUE_REFUSED = re.compile(r"WRONGTYPE|can't be converted|is not an integer|is not a (valid )?float")


def _value_refused(e: Exception) -> bool:
    return type(e).__name__ == "ResponseError" and _VALUE_REFUSED.search(str(e)) is not None


def _answers(results: list[Any]) -> list[Any]:
    """A pipeline's answers (run with ``raise_on_error=False``), None for a command on a key
    someone else put under the prefix with another type (no session of the store's is there);
    any other error is raised."""
    for x in results:
        if isinstance(x, Exception) and not _wrong_type(x):
            raise x
    return [None if isinstance(x, Exception) else x for x in results]


_TAIL = ("n_turns", "last_prompt", "last_output", "last_finished_at", "last_replica")


def _tail(n: str, prompt: str | None, output: str | None, finished: str | None, replica: str | None) -> tuple:
    return int(n), int(prompt or 0), int(output or 0), float(finished) if finished else None, replica or None


def _exact(x: float | int) -> str:
    """A number for a script: as text, so that Lua's 14-digit numbers do not round it."""
    return repr(float(x)) if isinstance(x, float) else str(int(x))


def _turn(record: RequestRecord, tail: Any) -> dict[str, Any]:
    """What the add script applies: the record's totals, and its turn if it has a session."""
    turn: dict[str, Any] = {
        # once per request, even where clients reuse their request ids (X-Request-Id)
        "request_id": f"{record.replica}|{record.engine_request_id or record.request_id}|{record.finished_at!r}",
        "model": record.model,
        "totals": [
            v for k, x in zip(MODEL_TOTALS, model_totals_row(record), strict=True) for v in (k, _exact(x))
        ],
    }
    if record.tenant is not None:
        turn["tenant"] = record.tenant
    if record.lora_name is not None:
        turn["lora"] = record.lora_name
    if record.session_id is not None:
        turn.update(
            session_id=record.session_id,
            finished_at=_exact(record.finished_at),
            replica=record.replica or "",
            last_prompt=tail.last_prompt,
            last_output=tail.last_output,
            sums=[v for k in SUMMED for v in (k, _exact(getattr(record, k) or 0.0))],
            row=json.dumps(turn_row(record, None)),
        )
    return turn


def session_summary(session_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """A session's row as the SQLite store's ``session_summary`` gives it."""
    return {
        "session_id": session_id,
        "model": fields.get("model", ""),
        "turns": readable(fields.get("n_turns")),
        "turns_dropped": readable(fields.get("turns_dropped")),
        "first_seen": _seconds(fields.get("first_seen")),
        "last_seen": _seconds(fields.get("last_seen")),
        **{k: readable(fields.get(k)) for k in SUMMED},
    }


def _seconds(text: str | None) -> float | None:
    x = readable(text)
    return None if x is None else float(x)


def _turn_row(text: str) -> dict[str, Any] | None:
    """A stored turn row; None where another writer left something else in the list."""
    try:
        row = json.loads(text)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class RedisSessionLedger(SessionLedger):
    """The session ledger on a Redis store: the turn accounting of ``SessionLedger``, its
    transactions and reads in Redis. While the store is unreachable, a turn's context comes
    from this process's latest turns (a session it has not seen starts at turn 1)."""

    RECENT_TAILS = 10_000  # sessions whose latest committed turn here is remembered

    def __init__(self, store: str | Path | None, *, timeout_s: float = TIMEOUT_S, **kwargs: Any) -> None:
        self._timeout_s = timeout_s  # read by ``_open``, which the base class calls
        super().__init__(store, **kwargs)

    def _open(self, path: str | Path | None, max_queued: int) -> RedisStore:
        # The latest turn this process committed per session, for a context while the store is down.
        self._recent: OrderedDict[str, Tail] = OrderedDict()
        # The store's latest turns of the sessions of the pass being priced, read in one round
        # trip (``prefetch``); each is used once, by its session's next context read.
        self._prefetched: dict[str, Tail | None] = {}
        # Turns, and groups of observations (an id each), the store has not taken yet (it
        # failed, or is left alone), oldest first.
        self._kept: deque[tuple[Any, ...]] = deque()
        self._kept_observed: deque[tuple[str, list[tuple[Any, ...]]]] = deque()
        self._more_to_close = False  # sessions were still due when the last batch stopped closing
        return RedisStore(
            str(path), self._commit, self._error, self.server_id, max_queued, timeout_s=self._timeout_s
        )

    def prefetch(self, session_ids: Iterable[str]) -> None:
        ids = sorted(set(session_ids))
        self._prefetched = {}
        if not ids or not self.store.available:
            return
        try:
            found = self.store.tails(ids)
        except StoreError as e:
            self._error(e)
            return
        self._prefetched = {sid: None if t is None else Tail(*t) for sid, t in zip(ids, found, strict=True)}

    def _stored_tail(self, session_id: str) -> Tail | None:
        if session_id in self._prefetched:
            return self._prefetched.pop(session_id)
        try:
            found = self.store.tail(session_id)
        except StoreError as e:
            self._error(e)
            return self._recent.get(session_id)
        return None if found is None else Tail(*found)

    def close(self) -> None:
        super().close()
        adds, observed = list(self._kept), list(self._kept_observed)
        self._kept, self._kept_observed = deque(), deque()
        n = len(adds) + sum(len(g) for _, g in observed)
        if n:  # the store never came back while this process ran
            self._lost(n, StoreError("unreachable until the server stopped"))
            self._settle(adds)

    def _commit(self, store: RedisStore, items: list[tuple[Any, ...]], expire: bool) -> None:
        now = self.clock()
        # the kept ones first, so that a session's turns land in order
        adds = [*self._kept, *(item for item in items if item[0] == "add")]
        observed = list(self._kept_observed)
        self._kept.clear()
        self._kept_observed.clear()
        if new := [item[1] for item in items if item[0] == "observe"]:
            observed.append((uuid.uuid4().hex, new))
        limits = (self.max_turns, self.feedback_window, self.max_sessions)
        watermarks = self.unlanded.watermarks(told_ids(adds))
        expire = expire or self._more_to_close
        if not adds and not observed and not expire:
            if store.available:
                with contextlib.suppress(StoreError):  # the next batch says what is wrong
                    store.beat(watermarks)
            return
        if (adds or observed) and not store.available:  # left alone: kept, with no attempt
            self._keep(adds, observed)
            return
        idle_before = now - self.idle_ttl_s if expire else 0.0
        try:
            turns, groups, closing = store.commit_batch(
                [(record, tail) for _, record, tail in adds],
                observed,
                now,
                idle_before,
                limits,
                watermarks,
            )
            failpoint("session_store")
        except Exception as e:
            self._keep(adds, observed)
            if adds or observed:
                self._error(StoreError(f"session store {self.path}: a batch kept for its return ({e})"))
            return
        for (_, record, tail), (seq, opened, dropped, *why) in zip(adds, turns, strict=True):
            if seq == REFUSED:  # not applied, and not to be sent again: it would be refused again
                self._lost(1, StoreError(f"request {record.request_id} not stored: {why[0]}"))
                continue
            if tail is not None:
                self._recent[record.session_id] = tail
                self._recent.move_to_end(record.session_id)
            self.stats.sessions_opened += opened
            self.stats.turns_dropped += dropped
        while len(self._recent) > self.RECENT_TAILS:
            self._recent.popitem(last=False)
        for (_, group), why in zip(observed, groups, strict=True):
            if why != 0:
                self._lost(len(group), StoreError(f"finished requests not observed: {why}"))
        self._settle(adds)
        self._closed(closing)
        # The rest of a mass closing, a chunk per call, for a while; then the next batch goes on.
        deadline = time.monotonic() + CLOSE_BUDGET_S
        while closing.more and time.monotonic() < deadline:
            try:
                closing = store.close_chunk(idle_before, self.max_sessions)
                failpoint("session_store")
            except Exception:  # the next batch's call hands over this chunk's sessions
                break
            self._closed(closing)
        self._more_to_close = closing.more

    def _closed(self, closing: Closing) -> None:
        """A close call's reply, read: its sessions are counted and told closed, and the store
        told not to send them again."""
        self.store.closing_read = closing.call
        self._set_live(closing.live)
        if closing.uncounted:
            self._error(
                StoreError(
                    f"session store {self.path}: {len(closing.closed)} closed sessions left out of the "
                    f"host's counts ({closing.uncounted})"
                )
            )
        for _, reason in closing.closed:
            if reason == "idle":
                self.stats.sessions_expired += 1
            else:
                self.stats.sessions_evicted += 1
        self._notify(closing.closed)

    def _keep(self, adds: list[tuple[Any, ...]], observed: list[tuple[str, list[tuple[Any, ...]]]]) -> None:
        """Turns and observations the store did not take, for the next batch; past the writer
        queue's bound (of each), the oldest are lost, counted."""
        bound = self.store.max_queued
        if (over := len(adds) - bound) > 0:
            lost, adds = adds[:over], adds[over:]
            self._lost(over, StoreError(f"more than {bound} turns waited for the store"))
            self._settle(lost)
        self._kept.extend(adds)
        waiting = sum(len(g) for _, g in observed)
        while waiting > bound:  # a whole group at a time: it is applied once, by its id
            _, group = observed.pop(0)
            waiting -= len(group)
            self._lost(len(group), StoreError(f"more than {bound} observations waited for the store"))
        self._kept_observed.extend(observed)


def open_ledger(store: str | None, timeout_s: float = TIMEOUT_S, **kwargs: Any) -> SessionLedger:
    """The ledger on the store ``PTE_SESSION_STORE`` names: a Redis URL (``timeout_s``: its
    command timeout) or a SQLite file."""
    if is_redis_url(store):
        return RedisSessionLedger(store, timeout_s=timeout_s, **kwargs)
    return SessionLedger(store, **kwargs)
