"""The Lua scripts of tenants' quotas (issue 31), beside their key names (schemas/tenants.py).

Run them through schemas/scripting.py's Script like every other script; docs/protocol.md
("Tenants") describes them for programs in other languages.
"""

# --- used by producer/quotas.py (the gateway and Client(tenant=...)) ---
# Count one request against its tenant's requests- and tokens-per-minute, or refuse it. Fixed
# one-minute windows on the server's clock (TIME): every gateway and producer shares the window,
# whatever its own clock says. A refused request is not counted (retrying costs nothing).
# KEYS[1] the tenant's rate hash; ARGV: rpm (0: none), tpm (0: none), this request's tokens,
# window seconds. Returns {verdict, requests, tokens, reset ms}: verdict `ok` (counted), or the
# limit it would pass (`requests` | `tokens`); requests / tokens: the window's counts after it.
RATE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local span = tonumber(ARGV[4]) * 1000
local win = math.floor(now / span)
local req, tok = 0, 0
if tonumber(redis.call('HGET', KEYS[1], 'window') or '-1') == win then
  req = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0') or 0
  tok = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0') or 0
end
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reset = (win + 1) * span - now
if rpm > 0 and req + 1 > rpm then return {'requests', req, tok, reset} end
if tpm > 0 and tok + cost > tpm then return {'tokens', req, tok, reset} end
redis.call('HSET', KEYS[1], 'window', win, 'requests', req + 1, 'tokens', tok + cost)
redis.call('PEXPIRE', KEYS[1], 2 * span)
return {'ok', req + 1, tok + cost, reset}
"""

# --- used by producer/client.py and producer/aio.py on a Redis Cluster ---
# Step 2 of a Cluster submit (schemas/scripts.py SUBMIT_JOB_LUA) for a tenant's job: what
# SUBMIT_LUA does on one server in the sub-stream's slot (group, XADD with `cost`, join the ring).
# KEYS[1] sub-stream, KEYS[2..4] the lane's fair ring, active and known sets; ARGV: job JSON,
# tenant, cost, group, fair state TTL. Returns the entry id.
FAIR_ENQUEUE_LUA = """
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[4], '0', 'MKSTREAM')
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1], 'cost', ARGV[3])
redis.call('SADD', KEYS[4], ARGV[2])
if redis.call('SADD', KEYS[3], ARGV[2]) == 1 then redis.call('RPUSH', KEYS[2], ARGV[2]) end
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return entry
"""

# --- used by workers/worker.py (instead of READ_LUA: the same budgets and reply) ---
# Read one lane shard's new entries, the high lane first (up to ARGV[3]), then normal and low
# (sharing what is left of ARGV[4]). Within a lane whose fair ring is empty this is READ_LUA's
# one XREADGROUP. Otherwise the lane stream itself (the default tenant) and each backlogged
# tenant's sub-stream take turns in deficit round robin: a turn adds quantum x weight tokens of
# credit and reads entries one by one while credit remains, each costing its `cost` field
# (ARGV[6] when it has none), so a huge job leaves its tenant in debt for later turns. The
# state (credits; `:cursor` and `:resume`: whose turn is under way; ':' is in no tenant name) is
# shared by every worker: fairness is pool-wide.
# A tenant whose sub-stream has nothing new leaves the ring (its producer's next submit brings
# it back) and keeps no credit. Sub-stream keys are the lane's key + ':t:' + tenant: the same
# hash tag, so one slot.
# KEYS: high, normal, low lane streams, then per lane its ring, active set, deficit hash.
# ARGV: group, consumer, high count, capacity, quantum, default cost, state TTL, then
# tenant / weight pairs (absent: weight 1; 0: skip it this time, it is at its concurrency cap).
# Returns READ_LUA's shape: {{stream, entries}, ...}.
FAIR_READ_LUA = """
local group, consumer = ARGV[1], ARGV[2]
local quantum, default_cost, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local weights = {}
for i = 8, #ARGV - 1, 2 do weights[ARGV[i]] = tonumber(ARGV[i + 1]) end
local out = {}
local function take(key, n)
  if n <= 0 then return 0 end
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
  if not r then return 0 end
  table.insert(out, r[1])
  return #r[1][2]
end
local function read_one(key)
  local ok, r = pcall(redis.call, 'XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                      'STREAMS', key, '>')
  if not ok or not r or #r[1][2] == 0 then return nil end
  return r[1][2][1]
end
-- an entry's `cost` and a deficit are anyone's writes: a count below 1 (a negative cost was
-- unbounded credit), NaN, inf or junk reads as the default (a deficit: 0)
local function finite(v)
  local n = tonumber(v)
  if not n or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end
local function cost_of(fields)
  if type(fields) ~= 'table' then return default_cost end
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'cost' then
      local c = finite(fields[i + 1])
      return (c and c >= 1) and c or default_cost
    end
  end
  return default_cost
end
local function fair(main, ring, active, deficit, n)
  if n <= 0 then return 0 end
  local members = redis.call('LRANGE', ring, 0, -1)
  if #members == 0 then return take(main, n) end
  local order, streams, d, idle, got, skip = {'default'}, {main}, {}, {}, {}, {}
  for _, m in ipairs(members) do
    table.insert(order, m)
    table.insert(streams, main .. ':t:' .. m)
  end
  local cur, resume = 1, redis.call('HGET', deficit, ':resume') == '1'
  local at = redis.call('HGET', deficit, ':cursor')
  local live = 0
  for i, m in ipairs(order) do
    d[i] = finite(redis.call('HGET', deficit, m)) or 0
    if m == at then cur = i end
    skip[i] = weights[m] == 0  -- at its concurrency cap: not read now, keeps its place
    if not skip[i] then live = live + 1 end
  end
  if order[cur] ~= at then resume = false end
  local served, i, spins = 0, cur, 0
  while served < n and live > 0 and spins < 100000 do
    spins = spins + 1
    if not idle[i] and not skip[i] then
      if not resume then d[i] = d[i] + quantum * (weights[order[i]] or 1) end
      resume = false
      while d[i] > 0 and served < n do
        local e = read_one(streams[i])
        if not e then idle[i], d[i], live = true, 0, live - 1 break end
        got[i] = got[i] or {}
        table.insert(got[i], e)
        d[i], served = d[i] - cost_of(e[2]), served + 1
      end
      if served >= n and d[i] > 0 and not idle[i] then resume = true break end
    end
    i = i % #order + 1
  end
  for j, m in ipairs(order) do
    if got[j] then table.insert(out, {streams[j], got[j]}) end
    if idle[j] and j > 1 then
      redis.call('LREM', ring, 1, m)
      redis.call('SREM', active, m)
    end
    if d[j] == 0 then redis.call('HDEL', deficit, m) else redis.call('HSET', deficit, m, d[j]) end
  end
  redis.call('HSET', deficit, ':cursor', order[i] or 'default', ':resume', resume and '1' or '0')
  redis.call('EXPIRE', deficit, ttl)
  return served
end
local free = tonumber(ARGV[4])
free = free - fair(KEYS[1], KEYS[4], KEYS[5], KEYS[6], tonumber(ARGV[3]))
free = free - fair(KEYS[2], KEYS[7], KEYS[8], KEYS[9], free)
fair(KEYS[3], KEYS[10], KEYS[11], KEYS[12], free)
return out
"""

# --- used by workers/caps.py ---
# A tenant's concurrency cap (TenantLimits.max_concurrent), pool-wide, taken at claim time: a
# slot is a member of the tenant's running set (`<job id>@<worker>` -> deadline, ms on the
# server's clock),
# renewed by its worker's lease thread and removed when the job ends; a worker that dies leaks
# nothing, its slots lapse at their deadline. KEYS[1] the running set; ARGV: slot, cap, slot
# lifetime ms, `acquire` | `renew`. Returns 1 (held) or 0 (acquire: the tenant is at its cap).
# A renew puts back a slot the set lost (a Redis restart without persistence, a lease thread
# that stalled past the deadline): the job runs, so it counts.
SLOT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[4] ~= 'renew' and not held and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# --- used by workers/usage.py, after a result landed ---
# Fair pull charged a job its estimated cost when it was read (the entry's `cost`); once its
# result is in, the difference to what it really used (prompt + generated tokens) goes back to
# its tenant's credit, so the turns are measured in tokens served. Only while the tenant is
# still backlogged (in the active set; the lane stream's own `default` while the ring has
# anyone): a tenant that left has no credit to correct. KEYS[1] the lane's deficit hash,
# KEYS[2] its active set, KEYS[3] its ring; ARGV: member (tenant or `default`), tokens to give
# back (negative: more debt), state TTL. Returns 1 when applied.
FAIR_SETTLE_LUA = """
if ARGV[1] == 'default' then
  if redis.call('LLEN', KEYS[3]) == 0 then return 0 end
elseif redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
