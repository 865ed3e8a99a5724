-- Question: how much of its time is each GPU in use? NVIDIA's `nsys analyze` rule gpu_time_util (nsys 2025.3)
-- on the same export: per process and device, the span from the first GPU operation's start to the last one's
-- end cut into $chunks chunks of equal length (rounded up to a whole nanosecond, the last one cut at the span's
-- end); a chunk's in-use percentage is the time of the operations inside it over its length (concurrent
-- operations add up, so it can pass 100); chunks under $threshold percent are kept and consecutive ones merged,
-- weighting their percentages by length. With $threshold above every chunk's, one row per process and device:
-- its utilisation over the whole span. busy_pct: the union of the operations instead of their sum (never > 100).
WITH
ops AS (SELECT start, "end", globalPid >> 24 AS pid, deviceId FROM gpu_ops),
span AS (
    SELECT pid, deviceId, min(start) AS start, max("end") AS "end",
           ceil(CAST(max("end") - min(start) AS DOUBLE) / $chunks) AS chunk_size
    FROM ops GROUP BY pid, deviceId
),
chunk AS (
    SELECT s.pid, s.deviceId, c.i AS chunk_id, c.i * s.chunk_size + s.start AS cstart,
           least(c.i * s.chunk_size + s.start + s.chunk_size, s."end") AS cend
    FROM span AS s, range(CAST($chunks AS BIGINT)) AS c(i)
    WHERE c.i * s.chunk_size + s.start < least(c.i * s.chunk_size + s.start + s.chunk_size, s."end")
),
util AS (
    SELECT c.pid, c.deviceId, c.chunk_id, c.cstart, c.cend, c.cend - c.cstart AS size,
           -- (DuckDB's least/greatest skip NULLs: a chunk without ops must add 0, not its own length)
           coalesce(sum(CASE WHEN o.start IS NOT NULL THEN least(o."end", c.cend) - greatest(o.start, c.cstart) END),
                    0) / (c.cend - c.cstart) * 100 AS pct
    FROM chunk AS c
    LEFT JOIN ops AS o ON o.deviceId = c.deviceId AND o.pid = c.pid AND o.start < c.cend AND o."end" > c.cstart
    GROUP BY c.pid, c.deviceId, c.chunk_id, c.cstart, c.cend
    HAVING pct < $threshold
),
grouped AS (
    SELECT *, chunk_id - row_number() OVER (PARTITION BY pid, deviceId ORDER BY chunk_id) AS group_id FROM util
),
busy AS (
    SELECT pid, deviceId, sum(greatest(0, "end" - greatest(start, coalesce(before, start)))) AS busy_ns
    FROM (SELECT pid, deviceId, start, "end",
                 max("end") OVER (PARTITION BY pid, deviceId ORDER BY start, "end"
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
          FROM ops)
    GROUP BY pid, deviceId
)
SELECT
    g.pid & 16777215 AS pid,
    g.deviceId AS device_id,
    CAST(min(g.cstart) AS BIGINT) AS start_ns,
    CAST(max(g.cend) - min(g.cstart) AS BIGINT) AS dur_ns,
    round(sum(g.size * g.pct) / sum(g.size), 1) AS in_use_pct,
    round(100.0 * any_value(b.busy_ns) / nullif(any_value(s."end" - s.start), 0), 1) AS busy_pct
FROM grouped AS g
JOIN busy AS b ON b.pid = g.pid AND b.deviceId = g.deviceId
JOIN span AS s ON s.pid = g.pid AND s.deviceId = g.deviceId
GROUP BY g.pid, g.deviceId, g.group_id
ORDER BY in_use_pct, dur_ns;
