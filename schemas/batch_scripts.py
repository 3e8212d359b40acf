"""The Lua scripts of the server-side Batch API (producer/batch_driver.py, producer/batch_store.py),
beside their keys (schemas/keys.py, `Keys.batch*`). Each touches one batch's keys, which share
the hash tag `{<batch id>}`, so each runs in one Redis Cluster slot.

A batch is driven by one gateway at a time: the one whose token is in `Keys.batch_lease`. Every
write the driver makes to the batch's state goes through a script that checks that token first
(fencing, as workers/lease.py does for jobs): a gateway that stalled past its lease and lost the
batch to another writes nothing more.
"""

# Take or renew a batch's lease. KEYS[1] lease; ARGV: token, lease ms. Returns 1 (held) or 0.
BATCH_LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# Give a lease back (only the holder's). KEYS[1] lease; ARGV[1] token. Returns 1 or 0.
BATCH_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Answer one line, once. KEYS[1] lease, KEYS[2] batch hash, KEYS[3] done hash, KEYS[4] lines hash,
# KEYS[5] todo, KEYS[6] sent; ARGV: token, custom_id, the answer's JSON, the counter it adds to
# ("completed" | "failed"), the line's job id ("" for a line that never became a job), TTL
# seconds of the done hash.
# Returns 1 (answered now), 0 (it was answered before: nothing counted again), -1 (lease lost).
BATCH_ANSWER_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n = redis.call('HSETNX', KEYS[3], ARGV[2], ARGV[3])
if n == 1 then redis.call('HINCRBY', KEYS[2], ARGV[4], 1) end
if ARGV[5] ~= '' then
  redis.call('HDEL', KEYS[4], ARGV[5])
  redis.call('ZREM', KEYS[5], ARGV[5])
  redis.call('SREM', KEYS[6], ARGV[5])
end
if redis.call('TTL', KEYS[3]) < 0 then redis.call('EXPIRE', KEYS[3], ARGV[6]) end
return n
"""

# Move a batch from one of some states to another. KEYS[1] lease, KEYS[2] batch hash; ARGV: token
# ("" for a caller that needs no lease: the cancel route), the states it may leave
# (comma-separated), the new state, the stamp field set on entering it ("" for none), now, then
# field/value pairs to set with the move. Returns {1, old state} (moved), {0, state} (not in one
# of those states: nothing written), {-1, ''} (lease lost, or no such batch).
BATCH_MOVE_LUA = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-1, ''} end
local s = redis.call('HGET', KEYS[2], 'status')
if not s then return {-1, ''} end
local allowed = false
for st in string.gmatch(ARGV[2], '[^,]+') do
  if st == s then allowed = true end
end
if not allowed then return {0, s} end
redis.call('HSET', KEYS[2], 'status', ARGV[3])
if ARGV[4] ~= '' then redis.call('HSETNX', KEYS[2], ARGV[4], ARGV[5]) end
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
return {1, s}
"""

# Claim the sending of a batch's end event. KEYS[1] the webhook hash; ARGV: now (ms), claim ms,
# token. Returns 'go' (this sender holds it until now + claim ms), 'busy' (another does), or the
# state when it is no longer pending ('delivered', 'dead'; 'gone' when there is none).
WEBHOOK_CLAIM_LUA = """
local s = redis.call('HGET', KEYS[1], 'state')
if s ~= 'pending' then return s or 'gone' end
if tonumber(redis.call('HGET', KEYS[1], 'until') or '0') > tonumber(ARGV[1]) then
  return 'busy'
end
redis.call('HSET', KEYS[1], 'until', tonumber(ARGV[1]) + tonumber(ARGV[2]), 'holder', ARGV[3])
return 'go'
"""

# Record one try. KEYS[1] the webhook hash; ARGV: token, 1 (delivered) or 0, the most tries.
# Returns {tries, state}, or {-1, ''} when this sender's claim was lost (nothing recorded).
WEBHOOK_SETTLE_LUA = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then return {-1, ''} end
local tries = redis.call('HINCRBY', KEYS[1], 'tries', 1)
local state = 'pending'
if ARGV[2] == '1' then state = 'delivered' elseif tries >= tonumber(ARGV[3]) then state = 'dead' end
redis.call('HSET', KEYS[1], 'state', state)
redis.call('HDEL', KEYS[1], 'until', 'holder')
return {tries, state}
"""
