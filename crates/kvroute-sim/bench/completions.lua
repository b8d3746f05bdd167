-- wrk script: POST /v1/completions with 64-token token-id prompts shaped like chat traffic:
-- 48 tokens of one of 8 shared "system prompts" (cache hits after the first request) followed
-- by 16 tokens unique to the request (always a miss). So every request reuses 3 blocks, inserts
-- one new block and publishes one KV batch, and a small cache evicts continuously.
-- Usage: wrk -t2 -c64 -d10s -s completions.lua http://127.0.0.1:PORT/v1/completions
local counter = 0
local thread_id = 0
local prefixes = {}

function setup(thread)
  thread:set("thread_id", counter)
  counter = counter + 1
end

function init(args)
  for g = 0, 7 do
    local ids = {}
    for t = 0, 47 do
      ids[#ids + 1] = tostring(100 + g * 48 + t)
    end
    prefixes[g] = table.concat(ids, ",")
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

local n = 0
function request()
  n = n + 1
  -- 16 unique tokens: the request number in base 7000 digits, offset past the prefixes.
  local ids = {}
  local x = n * 64 + thread_id
  for t = 0, 15 do
    ids[#ids + 1] = tostring(1000 + (x + t * 7919) % 7000)
    x = math.floor(x / 3)
  end
  local body = '{"prompt":[' .. prefixes[n % 8] .. "," .. table.concat(ids, ",") .. '],"max_tokens":16}'
  return wrk.format(nil, nil, nil, body)
end
