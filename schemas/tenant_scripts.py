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
  req = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
  tok = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
end
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reset = (win + 1) * span - now
if rpm > 0 and req + 1 > rpm then return {'requests', req, tok, reset} end
if tpm > 0 and tok + cost > tpm then return {'tokens', req, tok, reset} end
redis.call('HSET', KEYS[1], 'window', win, 'requests', req + 1, 'tokens', tok + cost)
redis.call('PEXPIRE', KEYS[1], 2 * span)
return {'ok', req + 1, tok + cost, reset}
"""
