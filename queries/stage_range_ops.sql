-- Stage: which GPU operations, and which blocking host calls (host_syncs), belong to which range instance
-- (NVIDIA's rule: the ranges open on the CPU thread that launched the operation, at the time of its launch
-- call, every enclosing level counting; a sync API call is matched the same way, by its own call).
-- A launch call [launch_start, launch_end] is inside a range when start <= launch_start and launch_end <= end,
-- on the range's thread (scope 'thread': push/pop ranges and start/end ranges ended where they started) or
-- anywhere in its process (scope 'process': start/end ranges ended on another thread; nsys attributes nothing
-- to these, we attribute the process's launches inside their window).
--
-- Ranges of either style may overlap in any way (start/end ranges need not nest), so no stack is assumed.
-- Instead each thread's (and each process's) launches are numbered by launch start; a range then holds the
-- contiguous run of numbers whose launch call starts inside it, found by two ASOF joins, and its pairs are that
-- run unnested, the launch end then checked: O((R + L) log n + P) for R ranges, L launches, P pairs.

-- se_launches: the calls of each thread (scope 'thread', k = globalTid) and of each process (scope 'process',
-- k = pid), numbered 1.. by call start within it; built only for the scopes the ranges use. A call is a GPU
-- op's launch (op_id > 0) or a sync API call without a GPU op (op_id = -host_syncs.sync_id).
CREATE OR REPLACE TEMP TABLE se_launches AS
WITH used AS (SELECT DISTINCT scope FROM ranges),
calls AS (
    SELECT op_id, launch_tid, launch_start, launch_end FROM gpu_ops WHERE launch_tid IS NOT NULL
    UNION ALL
    SELECT -sync_id, tid, call_start, call_end FROM host_syncs WHERE op_id IS NULL
),
keyed AS (
    SELECT 'thread' AS scope, launch_tid AS k, op_id, launch_start, launch_end
    FROM calls WHERE 'thread' IN (SELECT scope FROM used)
    UNION ALL
    SELECT 'process', launch_tid >> 24, op_id, launch_start, launch_end
    FROM calls WHERE 'process' IN (SELECT scope FROM used)
)
SELECT scope, k, op_id, launch_start, launch_end,
       row_number() OVER (PARTITION BY scope, k ORDER BY launch_start, op_id) AS idx
FROM keyed;

-- se_points: per launch start time, the first and last number holding it (the ops of one graph launch, or
-- launches at one timestamp, share it).
CREATE OR REPLACE TEMP TABLE se_points AS
SELECT scope, k, launch_start AS ts, min(idx) AS first_idx, max(idx) AS last_idx
FROM se_launches GROUP BY scope, k, launch_start;

-- se_runs: per range, its run lo..hi: the first launch starting at or after the range's start, the last one
-- starting at or before its end (ranges with no such launch have no run).
CREATE OR REPLACE TEMP TABLE se_runs AS
WITH r AS (
    SELECT range_id, scope, CASE WHEN scope = 'thread' THEN tid ELSE proc END AS k, start, "end"
    FROM ranges
),
lo AS (
    SELECT r.*, p.first_idx AS lo
    FROM r ASOF JOIN se_points AS p ON p.scope = r.scope AND p.k = r.k AND r.start <= p.ts
)
SELECT lo.range_id, lo.scope, lo.k, lo."end", lo.lo, p.last_idx AS hi
FROM lo ASOF JOIN se_points AS p ON p.scope = lo.scope AND p.k = lo.k AND lo."end" >= p.ts
WHERE p.last_idx >= lo.lo;

-- range_calls: the runs unnested. Runs of one call (the usual range around one launch) join directly: unnest
-- costs ten times a join per row.
CREATE OR REPLACE TEMP TABLE range_calls AS
SELECT r.range_id, l.op_id
FROM se_runs AS r
JOIN se_launches AS l ON l.scope = r.scope AND l.k = r.k AND l.idx = r.lo
WHERE r.hi = r.lo AND l.launch_end <= r."end"
UNION ALL
SELECT r.range_id, l.op_id
FROM (SELECT * FROM se_runs WHERE hi > lo) AS r, unnest(range(r.lo, r.hi + 1)) AS u(idx)
JOIN se_launches AS l ON l.scope = r.scope AND l.k = r.k AND l.idx = u.idx
WHERE l.launch_end <= r."end";

-- range_ops: (range, GPU op) pairs. range_syncs: (range, host sync) pairs, a sync counting where its call is.
CREATE OR REPLACE TEMP TABLE range_ops AS
SELECT range_id, op_id FROM range_calls WHERE op_id > 0;

CREATE OR REPLACE TEMP TABLE range_syncs AS
SELECT range_id, -op_id AS sync_id FROM range_calls WHERE op_id < 0
UNION ALL
SELECT ro.range_id, s.sync_id FROM range_ops AS ro JOIN host_syncs AS s ON s.op_id = ro.op_id;
