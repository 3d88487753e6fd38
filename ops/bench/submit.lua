-- wrk: POST 1-GPU submissions to FAIRLEDGER_BENCH_ALLOCATION (default: an allocation of the
-- bench's year); FAIRLEDGER_TOKEN is the bearer.
wrk.method = "POST"
wrk.body = '{"allocation":"' .. (os.getenv("FAIRLEDGER_BENCH_ALLOCATION") or "org0/team0") .. '","gpus_per_node":1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("FAIRLEDGER_TOKEN")

-- FAIRLEDGER_BENCH_COUNT=N: each thread stops after N answers (a queue of a known length).
local limit = tonumber(os.getenv("FAIRLEDGER_BENCH_COUNT") or "0")
local answered = 0
response = function(status, headers, body)
  answered = answered + 1
  if limit > 0 and answered >= limit then
    wrk.thread:stop()
  end
end

-- The tail beyond wrk's 99%: one stalled fold shows here first.
done = function(summary, latency, requests)
  io.write(string.format("     99.9%%  %.2fms, max %.2fms over %d answers\n",
    latency:percentile(99.9) / 1000, latency.max / 1000, summary.requests))
end
