-- 100,000 distinct callers, rotated.
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", wrk.path, { ["X-Api-Key"] = "key-" .. (n % 100000) })
end
