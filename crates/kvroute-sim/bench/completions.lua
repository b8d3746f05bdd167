-- wrk script: POST /v1/completions with a token-id prompt. Each wrk thread cycles through
-- `prompts_per_thread` distinct 64-token prompts, so after the first pass every request hits
-- the prefix cache (steady-state routing traffic), while inserts and events still happen for
-- the first pass. Usage: wrk -s completions.lua http://127.0.0.1:30000/v1/completions
local counter = 0
local prompts_per_thread = 256
local thread_id = 0
local bodies = {}

function setup(thread)
  thread:set("thread_id", counter)
  counter = counter + 1
end

function init(args)
  for p = 0, prompts_per_thread - 1 do
    local ids = {}
    local base = (thread_id * prompts_per_thread + p) * 64
    for t = 0, 63 do
      ids[#ids + 1] = tostring((base + t) % 8000 + 3)
    end
    bodies[p] = '{"prompt":[' .. table.concat(ids, ",") .. '],"max_tokens":16}'
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

local n = 0
function request()
  n = n + 1
  return wrk.format(nil, nil, nil, bodies[n % prompts_per_thread])
end
