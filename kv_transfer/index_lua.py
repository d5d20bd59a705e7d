"""The KV index's Lua scripts (``kv_transfer.redis_index`` runs them; the schema is ``kv_transfer.index_schema``).

Each runs atomically inside Redis, so a reader never sees a holder's ``{ns}:kv:*`` fields, its
``{ns}:kv-of:{holder}`` hash and its stream disagree. Scripts touch keys they compute from their arguments,
so this targets a standalone Redis (or one shard per namespace), not Redis Cluster.
"""

# Walk the chain in order. Per worker: ``any`` = its leading blocks held in some tier, ``gpu`` = its leading
# blocks held in its KV pool; the store's leading blocks. Stop at the first block that continues nobody's
# prefix (the first block nobody holds, or once no worker and not the store still has an unbroken prefix).
# KEYS = the chain's kv keys. Returns {store count, worker, gpu count, any count, worker, ...}.
LOOKUP = """
local alive, alive_gpu, gpu, any, store = {}, {}, {}, {}, 0
for i = 1, #KEYS do
  local flat = redis.call('HGETALL', KEYS[i])
  local next_alive, next_gpu, extends = {}, {}, false
  for j = 1, #flat, 2 do
    local w, tier = flat[j], flat[j + 1]
    if w == 'store' then
      if store == i - 1 then store = i; extends = true end
    elseif i == 1 or alive[w] then
      next_alive[w] = true; any[w] = i; extends = true
      if tier == 'gpu' and (i == 1 or alive_gpu[w]) then next_gpu[w] = true; gpu[w] = i end
    end
  end
  if not extends then break end
  alive, alive_gpu = next_alive, next_gpu
end
local out = {store}
for w, n in pairs(any) do out[#out + 1] = w; out[#out + 1] = gpu[w] or 0; out[#out + 1] = n end
return out
"""

# A holder's batch of moves. KEYS: kv-of, events, events-seq (the holder's), workers.
# ARGV: holder, kv key prefix, events maxlen, '1' when the holder must be a registered worker, then pairs
# (op, space-separated hash hexes) with op a tier (the hashes' best tier is now op) or 'removed' (gone from
# every tier). Each pair is one stream entry with the holder's next sequence number. Returns the last
# sequence number, or nil (nothing written) when the worker is not registered: writes after a worker was
# pruned would leave entries nobody cleans up.
PUBLISH = """
local holder, prefix, maxlen = ARGV[1], ARGV[2], ARGV[3]
if ARGV[4] == '1' and redis.call('SISMEMBER', KEYS[4], holder) == 0 then return false end
local seq = 0
for a = 5, #ARGV, 2 do
  local op, joined = ARGV[a], ARGV[a + 1]
  for h in string.gmatch(joined, '%S+') do
    if op == 'removed' then
      redis.call('HDEL', prefix .. h, holder)
      redis.call('HDEL', KEYS[1], h)
    else
      redis.call('HSET', prefix .. h, holder, op)
      redis.call('HSET', KEYS[1], h, op)
    end
  end
  seq = redis.call('INCR', KEYS[3])
  if op == 'removed' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'seq', seq, 'type', 'removed', 'hashes', joined)
  else
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'seq', seq, 'type', 'stored', 'tier', op,
               'hashes', joined)
  end
end
return seq
"""

# Drop a worker's index entries (mode "index": a 'cleared' entry on its stream) or the worker entirely
# (modes "deregister", "expired": its stream and sequence go, a worker-down goes to the control stream).
# "expired" does nothing while the worker key still exists, so a live worker is never pruned by a race.
# KEYS: worker, load, workers, kv-of, control stream, draining, events, events-seq.
# ARGV: id, mode, kv key prefix, events maxlen.
DROP_WORKER = """
local id, mode, prefix, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if mode == 'expired' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local hashes = redis.call('HKEYS', KEYS[4])
for _, h in ipairs(hashes) do redis.call('HDEL', prefix .. h, id) end
redis.call('DEL', KEYS[4])
if mode == 'index' then
  if #hashes > 0 then
    local seq = redis.call('INCR', KEYS[8])
    redis.call('XADD', KEYS[7], 'MAXLEN', '~', maxlen, '*', 'seq', seq, 'type', 'cleared')
  end
  return #hashes
end
redis.call('DEL', KEYS[7], KEYS[8])
local gone = redis.call('SREM', KEYS[3], id) + redis.call('DEL', KEYS[1], KEYS[2]) + #hashes
if mode == 'deregister' then redis.call('SREM', KEYS[6], id) end
if gone == 0 then return 0 end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', maxlen, '*', 'type', 'worker-down', 'worker', id, 'reason', mode)
return 1
"""
