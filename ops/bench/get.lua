-- wrk: GET with the bearer token in FAIRLEDGER_TOKEN.
wrk.headers["Authorization"] = "Bearer " .. os.getenv("FAIRLEDGER_TOKEN")
