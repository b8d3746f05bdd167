-- wrk script: POST a 256-token token-array completion with max_tokens 1.
-- Usage: wrk -t1 -c32 -d10s -s completions.lua http://127.0.0.1:PORT/v1/completions
local ids = {}
for i = 0, 255 do ids[#ids + 1] = tostring(100 + i) end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","max_tokens":1,"prompt":[' .. table.concat(ids, ",") .. ']}'
