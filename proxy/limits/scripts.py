"""The Lua scripts of the Redis limits backend (proxy/limits/redis_backend.py).

Each runs atomically in Redis and reads the time from Redis (TIME), so every replica
counts on one clock. Times are milliseconds.

  concurrency  a ZSET per scope (the global one, one per key): member = slot id,
               score = the slot's expiry; expired members are removed before counting,
               so the slot of a replica that died goes after slot_ttl_s. The key itself
               expires slot_ttl_s after the last admission or renewal.
  rate         a hash {tokens, stamp} per key: a token bucket holding one minute's
               allowance, refilled continuously; it expires when it would be full again.
  tokens/min   the same shape per key, debited after the request by the tokens it used
               (it may go below zero; admission waits while it is at or below zero).
  fence        a ZSET per replica: member = a slot id this replica forgot (FORGET: an
               admission or release whose outcome it could not learn), score = when the
               tombstone expires (slot_ttl_s on). ADMIT of a tombstoned slot takes nothing.
"""

from __future__ import annotations

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS: this replica's fence zset, global zset [, key zset, rate hash, tokens hash]
# ARGV: slot id, slot ttl ms, global limit, key limit, rate per min, tokens per min (0: none)
# -> {0, 0} admitted; {1, 0} global full; {2, 0} key full; {3, wait ms} rate; {4, wait ms} tokens;
#    {5, 0} fenced: the slot was forgotten (FORGET) before this call ran, nothing is taken
ADMIT = _NOW + """
local slot, ttl = ARGV[1], tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[1], slot) then return {5, 0} end
local glimit, klimit = tonumber(ARGV[3]), tonumber(ARGV[4])
local rate, tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if glimit > 0 and redis.call('ZCARD', KEYS[2]) >= glimit then return {1, 0} end
local keyed = #KEYS > 2
if keyed then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if klimit > 0 and redis.call('ZCARD', KEYS[3]) >= klimit then return {2, 0} end
  if rate > 0 then
    local b = redis.call('HMGET', KEYS[4], 'tokens', 'stamp')
    local tokens, stamp = tonumber(b[1]), tonumber(b[2])
    if tokens == nil or stamp == nil then tokens, stamp = rate, now end
    tokens = math.min(rate, tokens + math.max(0, now - stamp) * rate / 60000)
    if tokens < 1 then
      redis.call('HSET', KEYS[4], 'tokens', tostring(tokens), 'stamp', now)
      return {3, math.ceil((1 - tokens) * 60000 / rate)}
    end
    tokens = tokens - 1
    redis.call('HSET', KEYS[4], 'tokens', tostring(tokens), 'stamp', now)
    redis.call('PEXPIRE', KEYS[4], math.ceil((rate - tokens) * 60000 / rate) + 1000)
  end
  if tpm > 0 then
    local b = redis.call('HMGET', KEYS[5], 'tokens', 'stamp')
    local tokens, stamp = tonumber(b[1]), tonumber(b[2])
    if tokens ~= nil and stamp ~= nil then
      tokens = math.min(tpm, tokens + math.max(0, now - stamp) * tpm / 60000)
      if tokens <= 0 then return {4, math.ceil((1 - tokens) * 60000 / tpm)} end
    end
  end
end
local expiry = now + ttl
redis.call('ZADD', KEYS[2], expiry, slot)
redis.call('PEXPIRE', KEYS[2], ttl)
if keyed then
  redis.call('ZADD', KEYS[3], expiry, slot)
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return {0, 0}
"""

# KEYS: global zset [, key zset [, tokens hash]]
# ARGV: slot id, tokens per min (0: none), tokens used (-1: unknown)
RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
if #KEYS > 1 then redis.call('ZREM', KEYS[2], ARGV[1]) end
local tpm, used = tonumber(ARGV[2]), tonumber(ARGV[3])
if #KEYS > 2 and tpm > 0 and used >= 0 then
""" + _NOW + """
  local b = redis.call('HMGET', KEYS[3], 'tokens', 'stamp')
  local tokens, stamp = tonumber(b[1]), tonumber(b[2])
  if tokens == nil or stamp == nil then tokens, stamp = tpm, now end
  tokens = math.min(tpm, tokens + math.max(0, now - stamp) * tpm / 60000) - used
  if tokens >= tpm then
    redis.call('DEL', KEYS[3])
  else
    redis.call('HSET', KEYS[3], 'tokens', tostring(tokens), 'stamp', now)
    redis.call('PEXPIRE', KEYS[3], math.ceil((tpm - tokens) * 60000 / tpm) + 1000)
  end
end
return 0
"""

# KEYS: the zsets of live slots; ARGV: slot ttl ms, then per key: its member count, its members.
# Only members still there are renewed (XX): a slot released (or forgotten) meanwhile is not
# brought back, whichever of the two calls Redis runs first. Then the members that expired
# (a dead replica's) are removed, so ZCARD reads true between admissions too.
RENEW = _NOW + """
local ttl = tonumber(ARGV[1])
local expiry = now + ttl
local pos = 2
local renewed = 0
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for _ = 1, n do
    renewed = renewed + redis.call('ZADD', key, 'XX', 'CH', expiry, ARGV[pos])
    pos = pos + 1
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('PEXPIRE', key, ttl)
end
return renewed
"""

# KEYS: this replica's fence zset, then the zsets the slots may be in; ARGV: slot ttl ms, then
# per zset: its member count, its members. Each slot is removed and tombstoned in the fence
# (score: the tombstone's expiry, slot ttl from now): an ADMIT of that slot still on its way
# (sent before an outage, run after this) finds the tombstone and takes nothing ({5, 0}); one
# that ran before this is undone by the ZREM. The slot ids are never reused.
FORGET = _NOW + """
local ttl = tonumber(ARGV[1])
local expiry = now + ttl
local pos = 2
for i = 2, #KEYS do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for _ = 1, n do
    redis.call('ZREM', KEYS[i], ARGV[pos])
    redis.call('ZADD', KEYS[1], expiry, ARGV[pos])
    pos = pos + 1
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return 0
"""
