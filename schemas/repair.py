"""The Lua scripts of operators' repairs (`genpool lanes check|repair`, producer/cli_lanes.py),
kept beside schemas/scripts.py (the scripts of the job's life): as there, each script touches the
keys of one Redis Cluster slot only, and docs/operations.md describes what they do.
"""

# --- used by producer/cli_lanes.py (`genpool lanes check|repair`) ---
# A lane stream whose last id is ahead of the clock: a raw `XADD <lane> <id>` with an id from the
# future (at worst the last possible one, 18446744073709551615-18446744073709551615, after which
# every XADD fails) made every later entry's id follow it. Mended in place, in one atomic step on
# the one key, so every queued and in-flight entry keeps its id, its consumer group and its
# pending record (job hashes name their entry by id: moving entries would orphan them):
#   - the entries ahead of the clock are acknowledged in every group, deleted, and added again
#     with fresh ids (their jobs stay queued; producer/cli_lanes.py first frees the job hash of
#     one a worker had claimed, so its copy can take over should that worker die);
#   - the stream's last id goes back to the newest remaining entry, or now (XSETID);
#   - a group whose last-delivered id is ahead goes back to its newest pending entry (entries
#     are delivered in id order, so every entry after that one is undelivered), or 0-0.
# KEYS[1] lane stream; ARGV: how far ahead of the server's clock an id may be (ms), "check" or
# "repair". Returns {last id, last id after (or ""), {old id, new id (or ""), job id (or ""), ...},
# {group, last-delivered id, set to (or ""), ...}}; a lane that is fine: {last, last, {}, {}}.
LANE_REPAIR_LUA = """
local function get(flat, name)
  for i = 1, #flat, 2 do if flat[i] == name then return flat[i + 1] end end
end
local function ms(id) return tonumber(string.match(id, '^%d+')) end
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' then return {'', '', {}, {}} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = now + tonumber(ARGV[1])
local last = get(redis.call('XINFO', 'STREAM', KEYS[1]), 'last-generated-id')
if ms(last) <= limit then return {last, last, {}, {}} end
local repair = ARGV[2] == 'repair'
local future = redis.call('XRANGE', KEYS[1], string.format('%.0f-0', limit + 1), '+')
local groups = {}
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  table.insert(groups, {get(g, 'name'), get(g, 'last-delivered-id')})
end
local top = redis.call('XREVRANGE', KEYS[1], string.format('%.0f-18446744073709551615', limit),
                       '-', 'COUNT', 1)
local new_last = string.format('%.0f-0', now)
if top[1] and ms(top[1][1]) >= now then new_last = top[1][1] end
if repair then
  for _, e in ipairs(future) do
    for _, g in ipairs(groups) do redis.call('XACK', KEYS[1], g[1], e[1]) end
    redis.call('XDEL', KEYS[1], e[1])
  end
  local maxdel = get(redis.call('XINFO', 'STREAM', KEYS[1]), 'max-deleted-entry-id')
  if maxdel and ms(maxdel) > limit then  -- (Redis 7) else XINFO's lag figures stay broken
    redis.call('XSETID', KEYS[1], new_last, 'MAXDELETEDID', new_last)
  else
    redis.call('XSETID', KEYS[1], new_last)
  end
end
local reset = {}
for _, g in ipairs(groups) do
  if ms(g[2]) > limit then
    local to = ''
    if repair then
      to = redis.call('XPENDING', KEYS[1], g[1])[3] or '0-0'
      redis.call('XGROUP', 'SETID', KEYS[1], g[1], to)
    end
    for _, v in ipairs({g[1], g[2], to}) do table.insert(reset, v) end
  end
end
-- the entry's job id, or '': the job field is anyone's bytes (no UTF-8, JSON nested past any
-- parser's depth), and the client decodes the reply as text
local function job_id(job)
  local ok, doc = pcall(cjson.decode, job or '')
  local id = ok and type(doc) == 'table' and doc['id']
  if type(id) == 'string' and #id <= 128 and string.match(id, '^[%w_.%-]+$') then return id end
  return ''
end
local moved = {}
for _, e in ipairs(future) do
  local new = repair and redis.call('XADD', KEYS[1], '*', unpack(e[2])) or ''
  for _, v in ipairs({e[1], new, job_id(get(e[2], 'job'))}) do table.insert(moved, v) end
end
return {last, repair and new_last or '', moved, reset}
"""

# --- used by producer/cli_lanes.py ---
# Before (and after) `genpool lanes repair` re-adds a lane entry under a new id: the job hash
# stops naming the old id as its owning entry, so the copy can claim the job (CLAIM_LUA sets
# `entry` when none is set) instead of being acknowledged as a duplicate. A worker running the
# job goes on (its lease is in the hash, not the entry), and a copy it meets is handed back to
# it; should it die, the copy reruns the job. KEYS[1] job hash; ARGV[1] old entry id. -> 1 | 0
ENTRY_UNBIND_LUA = """
if redis.call('HGET', KEYS[1], 'entry') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'entry')
  return 1
end
return 0
"""
