-- Every request from one caller.
wrk.headers["X-Api-Key"] = "bench-key"
