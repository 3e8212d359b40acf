"""Every Lua script genpool runs, beside the key names they act on (schemas/keys.py); those of
operators' repairs (`genpool lanes repair`) are in schemas/repair.py.

Each script touches the keys of one Redis Cluster slot only (see the `{...}` hash tags in
schemas/keys.py); docs/protocol.md describes them for programs in other languages.

The job-state machine (the `state` field of a job's hash, `Keys.job(id)`):

    queued --CLAIM_LUA--> running --FENCE_LUA final--> done | failed
       ^                    |  \--FENCE_LUA release (handed back, not a crash)--> queued
       |                    \--lease lost (worker died / stalled): reclaimed, CLAIM_LUA again
       \-- SUBMIT_LUA / SUBMIT_JOB_LUA (created once per id)
    any state --CANCEL_LUA / CANCEL_FLAG_LUA--> `cancel` flag set: the owner ends it as an error
    `cancelled`; a queued one is ended when a worker claims it.

`attempts` counts CLAIM_LUA's claims; `owner` is the current attempt's lease token, and every
write for the job is applied only while it still matches (fencing, workers/lease.py).
"""

# What a submit says when its lane stream refuses the XADD (SUBMIT_LUA and the Cluster submit).
LANE_REFUSED = ("nothing was stored; `genpool lanes check` says what is wrong with the lane, "
                "`genpool lanes repair` mends one whose entry ids ran out (docs/operations.md)")

# --- used by producer/protocol.py ---
# Atomic "create unless it exists" + enqueue. One script call is one round trip and cannot leave a
# job hash without its stream entry (which a two-step HSETNX-then-XADD could after a crash).
# The XADD comes before any write: a lane that refuses it (its ids ran out after a raw XADD of
# the last possible id, a key of another type) fails the submit with nothing stored, so a
# resubmit of the id is not mistaken for a duplicate (a script's writes are never rolled back).
# KEYS[1] job hash, KEYS[2] lane stream; ARGV: job JSON, lane, submit time, TTL seconds, and
# optionally the job's tenant (kept in the hash for isolation checks; absent means "default").
# ARGV[6], optional: the job's cost in estimated tokens, the entry's `cost` (fair pull reads it).
# A tenant's job (fair pull, schemas/tenants.py) has KEYS[2] its sub-stream and KEYS[3..5] the
# lane's fair ring, active and known sets, and ARGV[7..8] the consumer group and the fair
# state's TTL: the group is made with the sub-stream, and the tenant joins the ring if it was
# not backlogged.
# Returns the stream entry id, or false when the job id already exists (it runs only once).
SUBMIT_LUA = """
if redis.call('HEXISTS', KEYS[1], 'state') == 1 then
  return false
end
local fields = {'job', ARGV[1]}
if ARGV[6] then fields = {'job', ARGV[1], 'cost', ARGV[6]} end
if #KEYS > 2 then
  pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], ARGV[7], '0', 'MKSTREAM')  -- BUSYGROUP: made
end
local ok, entry = pcall(redis.call, 'XADD', KEYS[2], '*', unpack(fields))
if not ok then
  local why = type(entry) == 'table' and entry.err or tostring(entry)
  return redis.error_reply('ERR lane stream ' .. KEYS[2] .. ' refused the job: ' .. why ..
                           ' (""" + LANE_REFUSED + """)')
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'entry', entry, 'lane', ARGV[2],
           'submitted_at', ARGV[3], 'attempts', 0)
if ARGV[5] then redis.call('HSET', KEYS[1], 'tenant', ARGV[5]) end
if #KEYS > 2 then
  redis.call('SADD', KEYS[5], ARGV[5])
  if redis.call('SADD', KEYS[4], ARGV[5]) == 1 then redis.call('RPUSH', KEYS[3], ARGV[5]) end
  for i = 3, 5 do redis.call('EXPIRE', KEYS[i], ARGV[8]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return entry
"""

# --- used by producer/protocol.py ---
# Redis Cluster: a job's hash and its lane stream are in different hash slots, so no one script may
# touch both. There the submit is three one-slot steps: this script (claim the id unless an entry
# already owns it), XADD, then HSETNX `entry`. A crash between steps leaves a hash without `entry`,
# which a retried submit completes; two racing submits may both XADD, and the worker's CLAIM_LUA
# runs only the entry that claims the id first (the rule that makes a plain XADD safe).
# KEYS[1] job hash; ARGV: lane, submit time, TTL seconds, optionally the tenant.
# Returns 1, or false (already queued).
SUBMIT_JOB_LUA = """
if redis.call('HEXISTS', KEYS[1], 'entry') == 1 then
  return false
end
redis.call('HSETNX', KEYS[1], 'state', 'queued')
if redis.call('HSETNX', KEYS[1], 'lane', ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], 'submitted_at', ARGV[2], 'attempts', 0)
  if ARGV[4] then redis.call('HSET', KEYS[1], 'tenant', ARGV[4]) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return 1
"""

# --- used by producer/client.py and producer/aio.py ---
# Redis Cluster: the lane refused the XADD of step 2 (above), so take back what this submit's
# SUBMIT_JOB_LUA stored: only while no entry owns the id and `submitted_at` is this submit's
# (an earlier submit's hash is left as it is). A cancel flag or a `retry_of` mark stays.
# KEYS[1] job hash; ARGV: the submit time given to SUBMIT_JOB_LUA. Returns 1 (taken back) or 0.
SUBMIT_UNDO_LUA = """
if redis.call('HEXISTS', KEYS[1], 'entry') == 1 or
   redis.call('HGET', KEYS[1], 'submitted_at') ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[1], 'state', 'lane', 'submitted_at', 'attempts', 'tenant')
return 1
"""

# --- used by producer/dead.py ---
# `dead retry`, step 1 of 3 (then the submit, then XDEL of the dead letter): drop the dead job's
# hash and event stream (its terminal event would end a new reader at once) and mark the fresh
# hash `retry_of` = the dead-letter entry id, with a TTL. A retry cut off after step 2 and run
# again finds its own mark beside an `entry` and does not enqueue twice. Anyone can XADD a dead
# letter, so only a job that is dead (or gone, or whose key is not a job hash) is replaced: one
# queued, running or finished under that id is refused untouched.
# KEYS[1] job hash, KEYS[2] job event stream; ARGV: dead-letter entry id, TTL seconds.
# Returns 1 (go on with the submit), 0 (this dead letter's job is already queued again), or the
# state of a job that is not dead (nothing was touched).
RETRY_RESET_LUA = """
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  if redis.call('HGET', KEYS[1], 'retry_of') == ARGV[1] then
    if redis.call('HEXISTS', KEYS[1], 'entry') == 1 then
      return 0
    end
    return 1
  end
  local state = redis.call('HGET', KEYS[1], 'state')
  if state and state ~= 'dead' then
    return state
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'retry_of', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# --- used by producer/client.py and producer/aio.py (arguments: producer/protocol.py cancel_args) ---
# The cancel flag, keeping the hash's TTL if it has one (EXPIRE NX needs Redis 7).
# KEYS[1] job hash; ARGV: job id, time, TTL seconds, control stream cap.
_CANCEL_FLAG = """
redis.call('HSET', KEYS[1], 'cancel', '1', 'cancel_at', ARGV[2])
if redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
"""
# Redis Cluster's cancel, step 1 of 2 (step 2 XADDs the broadcast): the flag first, so a worker
# that claims the job after this sees it, and one already running it gets the broadcast.
CANCEL_FLAG_LUA = _CANCEL_FLAG + "return 1\n"
# One server: the flag and the broadcast on the control stream (KEYS[2]) in one script.
CANCEL_LUA = _CANCEL_FLAG + "return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'op', 'cancel', 'id', ARGV[1])\n"

# --- used by workers/streams.py ---
# Decide, atomically per job, whether this worker may run an entry, and give this attempt its lease.
# It guards the "a job id runs once" rule for producers that XADD directly (without the submit
# script): the first entry to claim a job id owns it, and any other entry with the same id is a
# duplicate. It never starts a job another worker holds an unexpired lease on ('leased'), and it
# attributes a lost worker: if the previous attempt ran alone in its engine (`solo`), the job is
# charged (`charges`, dead-lettered after max deliveries); if it shared a batch, only its `suspect`
# count grows. A job suspect twice runs alone (one lost worker is usually a kill or a node going
# away, and batch-mates of a poison job are then cleared by their own solo runs), so batch-mates
# never pay for one job's crash and a plain SIGKILL costs no throughput.
# KEYS[1] job hash; ARGV: entry id, worker name, now, TTL seconds, mode ("run" or "check"),
# token, lease ms, the entry's delivery count, max deliveries.
# Returns {verdict, detail, attempt, suspect}: run, check, cancelled, dead (detail: why),
# duplicate (owner entry), finished (state), leased (holder).
CLAIM_LUA = """
local owner = redis.call('HGET', KEYS[1], 'entry')
if owner and owner ~= ARGV[1] then return {'duplicate', owner, 0, 0} end
local state = redis.call('HGET', KEYS[1], 'state')
if state and state ~= 'queued' and state ~= 'running' then return {'finished', state, 0, 0} end
if not owner then redis.call('HSET', KEYS[1], 'entry', ARGV[1]) end
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder then
  if (tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') or 0) > now then
    return {'leased', redis.call('HGET', KEYS[1], 'worker') or '', 0, 0}
  end
  if redis.call('HGET', KEYS[1], 'solo') == '1' then
    redis.call('HINCRBY', KEYS[1], 'charges', 1)
  elseif state == 'running' then
    redis.call('HINCRBY', KEYS[1], 'suspect', 1)
  end
  redis.call('HDEL', KEYS[1], 'owner', 'lease_until', 'solo')
end
redis.call('HSET', KEYS[1], 'owner', ARGV[6], 'lease_until', now + tonumber(ARGV[7]))
-- `or 0`: a field someone else wrote that is no number reads 0, not nil (a nil would end the
-- reply's table early, and a comparison with it fail the script)
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0') or 0
local charges = tonumber(redis.call('HGET', KEYS[1], 'charges') or '0') or 0
local maxd = tonumber(ARGV[9])
if charges >= maxd then
  return {'dead', 'its worker was lost ' .. charges .. ' times while running it alone (max ' ..
          maxd .. ' deliveries)', attempts, 0}
end
if attempts == 0 and tonumber(ARGV[8]) > maxd then
  return {'dead', 'delivered ' .. ARGV[8] .. ' times (max ' .. maxd ..
          '): its workers died or stalled', attempts, 0}
end
if ARGV[5] ~= 'run' then return {'check', '', attempts, 0} end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {'cancelled', '', attempts, 0} end
local suspect = tonumber(redis.call('HGET', KEYS[1], 'suspect') or '0') or 0
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'started_at', ARGV[3])
return {'run', '', redis.call('HINCRBY', KEYS[1], 'attempts', 1), suspect}
"""

# --- used by workers/streams.py ---
# Read new entries lane by lane in ONE round trip, never more than the worker can hold: the high
# lane up to ARGV[3] (it may exceed capacity so interactive work can preempt), then normal, then
# low, sharing what is left of ARGV[4]. (Separate XREADGROUPs would need one round trip each, and
# one multi-stream XREADGROUP applies COUNT per stream, over-pulling.)
# KEYS: high, normal, low lane streams; ARGV: group, consumer, high count, capacity.
READ_LUA = """
local out, free = {}, tonumber(ARGV[4])
local function take(key, n)
  if n <= 0 then return 0 end
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', key, '>')
  if not r then return 0 end
  table.insert(out, r[1])
  return #r[1][2]
end
free = free - take(KEYS[1], tonumber(ARGV[3]))
free = free - take(KEYS[2], free)
take(KEYS[3], free)
return out
"""

# --- used by workers/streams.py ---
# Deployment settings a worker publishes for producers: the lane-shard count only ever grows, so
# a producer never enqueues on a shard that some worker does not read. KEYS[1] meta hash;
# ARGV: this worker's shard count, TTL seconds, the most shards there may be. Returns the count
# to read (the larger one). A stored value that is no count in range (someone else's write) is
# replaced by ours: a Lua error or a count past the bound would stop every worker's start.
SHARDS_LUA = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'lane_shards') or '1')
if not stored or stored ~= math.floor(stored) or stored < 1 or stored > tonumber(ARGV[3]) then
  stored = 1
end
local n = math.max(stored, tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'lane_shards', n)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return n
"""

# --- used by workers/outbox.py ---
# Acknowledge a lane entry (XACK + XDEL: acked entries are deleted, so XLEN = queued + pending),
# with its dead letter, if it has one, in the same script. The dead letter goes first: a server
# under memory pressure refuses a script whose first write may add memory, and lets the deletes
# after it pass once it began, so a refused dead letter leaves the entry pending, never acked
# without it (pipelined, the XADD was refused while the XACK + XDEL beside it passed). Only an
# entry still pending is dead-lettered, so a resend never writes a second dead letter.
# KEYS[1] lane stream, KEYS[2] dead-letter stream (only with a dead letter: one slot, so on a
# Redis Cluster only lane shard 0's entries come here with theirs; see workers/outbox.py);
# ARGV: group, entry id, dead-letter cap, then the dead letter's field/value pairs.
# Returns 1 when it acknowledged a pending entry, 0 when the entry was no longer pending.
ACK_LUA = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then
  redis.call('XDEL', KEYS[1], ARGV[2])
  return 0
end
if #KEYS > 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# --- used by workers/lease.py ---
# KEYS[1] job hash, KEYS[2] its event stream. ARGV[1] token, ARGV[2] op, then per op:
#   renew:   ARGV[3] lease ms                         -> 1 | 0
#   solo:    (none) the attempt runs alone in its engine -> 1 | 0
#   release: (none) hand the job back unfinished (not a crash) -> 1 | 0
#   events:  ARGV[3] maxlen, ARGV[4] stream TTL, ARGV[5..] event JSONs -> 1 | 0
#            (each entry: `event` = the JSON, `seq` = its place in the log; hash field `seq`)
#   final:   ARGV[3] maxlen, ARGV[4] result TTL, ARGV[5] state, ARGV[6] field, ARGV[7] time,
#            ARGV[8] worker, ARGV[9..] event JSONs (the last one terminal) -> 1 | 0
#   final+usage: as final, then ARGV[9] tenant, ARGV[10] prompt tokens, ARGV[11] completion
#            tokens, ARGV[12] usage TTL, ARGV[13..] event JSONs; KEYS[3] the hour's usage hash
#            (schemas/tenants.py), counted in the same fenced write as the result, so a resend,
#            a rerun or a resume never counts a job twice (one server or Sentinel only: on a
#            Cluster KEYS[3] is in another slot, and workers/usage.py counts after the write)
FENCE_LUA = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local op = ARGV[2]
if op == 'renew' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[3]))
  return 1
elseif op == 'solo' then
  redis.call('HSET', KEYS[1], 'solo', '1')
  return 1
elseif op == 'release' then
  redis.call('HSET', KEYS[1], 'state', 'queued')
  redis.call('HDEL', KEYS[1], 'owner', 'lease_until', 'solo')
  return 1
end
local final = op == 'final' or op == 'final+usage'
local first = (op == 'final+usage') and 13 or (final and 9 or 5)
local last = ''
-- `seq`: each entry's place in the job's event log (1, 2, ...; counted in the hash), so that a
-- reader which fell more than the MAXLEN cap behind can tell what was trimmed unread
local seq = redis.call('HINCRBY', KEYS[1], 'seq', #ARGV - first + 1) - (#ARGV - first + 1)
for i = first, #ARGV do
  seq = seq + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', ARGV[i], 'seq', seq)
end
if final then
  redis.call('HSET', KEYS[1], 'state', ARGV[5], ARGV[6], ARGV[#ARGV], 'finished_at', ARGV[7],
             'worker', ARGV[8])
  if op == 'final+usage' then
    redis.call('HINCRBY', KEYS[3], ARGV[9] .. ':prompt', ARGV[10])
    redis.call('HINCRBY', KEYS[3], ARGV[9] .. ':completion', ARGV[11])
    redis.call('HINCRBY', KEYS[3], ARGV[9] .. ':jobs', 1)
    redis.call('EXPIRE', KEYS[3], ARGV[12])
  end
  redis.call('HDEL', KEYS[1], 'owner', 'lease_until', 'solo', 'suspect')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
elseif redis.call('TTL', KEYS[2]) < 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return 1
"""
