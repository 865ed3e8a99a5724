-- Question: where, over the whole trace, is a GPU idle for longer than $gap_ns? NVIDIA's `nsys analyze` rule
-- gpu_gaps (nsys 2025.3) on the same export: per process and device, from the first GPU operation's start to the
-- last one's end, the i-th end in end order paired with the (i+1)-th start in start order; a gap is a pair
-- whose start is later than its end by more than $gap_ns (the rule's `gap` option, in whole milliseconds there).
-- Operations: kernels, copies and sets. The rule also counts nsys's profiling overhead as GPU work; the exports
-- this project records show no difference (tests/test_analyze_gaps.py compares every fixture).
WITH
ops AS (SELECT start, "end", globalPid >> 24 AS pid, deviceId FROM gpu_ops),
starts AS (
    SELECT row_number() OVER (ORDER BY pid, deviceId, start) AS rn, start, pid, deviceId FROM ops
),
ends AS (
    SELECT row_number() OVER (ORDER BY pid, deviceId, "end") AS rn, "end", pid, deviceId FROM ops
)
SELECT
    e.pid & 16777215 AS pid,
    e.deviceId AS device_id,
    e."end" AS start_ns,
    s.start AS end_ns,
    s.start - e."end" AS gap_ns
FROM starts AS s
JOIN ends AS e ON s.rn - 1 = e.rn AND s.deviceId = e.deviceId AND s.pid = e.pid
WHERE s.start - e."end" > $gap_ns AND e."end" < s.start
ORDER BY gap_ns DESC, start_ns;
