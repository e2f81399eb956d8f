-- Each request a new caller until KEYS callers have sent one request each; after that one
-- known caller, so no more keys are created. KEYS comes from the environment.
local keys = tonumber(os.getenv("KEYS") or "1000000")
local n = 0
request = function()
  n = n + 1
  local key = n <= keys and ("mem-" .. n) or "mem-done"
  return wrk.format("GET", wrk.path, { ["X-Api-Key"] = key })
end
