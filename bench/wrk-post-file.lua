-- wrk script for bench/side_by_side.sh: POST the bytes of $WRK_BODY_FILE as JSON on every
-- request (one fixed body per run, so wrk's own cost per request stays constant across rows).
local path = os.getenv("WRK_BODY_FILE")
assert(path, "set WRK_BODY_FILE")
local f = assert(io.open(path, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
