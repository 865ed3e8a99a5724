-- Stage: which GPU operations belong to which range instance (NVIDIA's rule: the ranges open on the CPU
-- thread that launched the operation, at the time of its launch call, every enclosing level counting).
-- A launch call [launch_start, launch_end] is inside a range when start <= launch_start and launch_end <= end.

-- se_launches: the launches of each thread (scope 'thread', k = globalTid) and of each process (scope
-- 'process', k = pid), numbered 1.. by launch start within it; built only for the scopes start/end ranges use.
-- se_points: per launch start time, the first and last position holding it (ops of one graph launch share it).
CREATE OR REPLACE TEMP TABLE se_launches AS
WITH used AS (SELECT DISTINCT scope FROM ranges WHERE style = 'StartEnd'),
keyed AS (
    SELECT 'thread' AS scope, launch_tid AS k, op_id, launch_start, launch_end
    FROM gpu_ops WHERE launch_tid IS NOT NULL AND 'thread' IN (SELECT scope FROM used)
    UNION ALL
    SELECT 'process', launch_tid >> 24, op_id, launch_start, launch_end
    FROM gpu_ops WHERE launch_tid IS NOT NULL AND 'process' IN (SELECT scope FROM used)
)
SELECT scope, k, op_id, launch_start, launch_end,
       row_number() OVER (PARTITION BY scope, k ORDER BY launch_start, op_id) AS idx
FROM keyed;

CREATE OR REPLACE TEMP TABLE se_points AS
SELECT scope, k, launch_start AS ts, min(idx) AS first_idx, max(idx) AS last_idx
FROM se_launches GROUP BY scope, k, launch_start;

-- se_runs: per start/end range, its run of positions lo..hi: the first launch starting at or after the
-- range's start, the last starting at or before its end (lo > hi or NULL: none).
CREATE OR REPLACE TEMP TABLE se_runs AS
WITH r AS (
    SELECT range_id, scope, CASE WHEN scope = 'thread' THEN tid ELSE proc END AS k, start, "end"
    FROM ranges WHERE style = 'StartEnd'
),
lo AS (
    SELECT r.*, p.first_idx AS lo FROM r ASOF JOIN se_points AS p ON p.scope = r.scope AND p.k = r.k AND r.start <= p.ts
)
SELECT lo.range_id, lo.scope, lo.k, lo."end", lo.lo, p.last_idx AS hi
FROM lo ASOF JOIN se_points AS p ON p.scope = lo.scope AND p.k = lo.k AND lo."end" >= p.ts
WHERE p.last_idx >= lo.lo;

CREATE OR REPLACE TEMP TABLE range_ops AS
WITH innermost AS (
    -- The innermost push/pop range open at the launch call: one ASOF join against the thread's sweep state.
    SELECT o.op_id, o.launch_end, s.open_id
    FROM gpu_ops AS o
    ASOF JOIN pp_state AS s ON o.launch_tid = s.tid AND o.launch_start >= s.ts
    WHERE s.open_id IS NOT NULL
)
SELECT a.ancestor_id AS range_id, i.op_id
FROM innermost AS i
JOIN ranges AS r ON r.range_id = i.open_id AND r."end" >= i.launch_end
JOIN range_anc AS a ON a.range_id = i.open_id
UNION ALL
-- Start/end ranges overlap freely (no stack), so no sweep state names them; they are found by position
-- instead. se_launches numbers each thread's (and each process's) launches in launch-start order; a range
-- then holds the contiguous run of positions whose launch call starts inside it, found by two ASOF joins,
-- and its pairs are that run unnested: O((R + L) log n + P), no interval join.
SELECT r.range_id, l.op_id
FROM se_runs AS r, unnest(range(r.lo, r.hi + 1)) AS u(idx)
JOIN se_launches AS l ON l.scope = r.scope AND l.k = r.k AND l.idx = u.idx
WHERE l.launch_end <= r."end";

-- range_instances: per range instance, its GPU projection (first GPU op start to last GPU op end, memory
-- copies and sets included, even when they run after the range closed) and its GPU op count (one per
-- launch call: the node kernels of one graph launch are one op, as nvtx_gpu_proj_sum counts them).
CREATE OR REPLACE TEMP TABLE range_instances AS
WITH agg AS (
    SELECT
        r.range_id,
        min(o.start) AS proj_start,
        max(o."end") AS proj_end,
        count(DISTINCT o.correlationId) AS gpu_ops,
        count(o.op_id) FILTER (WHERE o.kind = 'kernel') AS kernels
    FROM ranges AS r
    LEFT JOIN range_ops AS ro ON ro.range_id = r.range_id
    LEFT JOIN gpu_ops AS o ON o.op_id = ro.op_id
    GROUP BY r.range_id
)
SELECT
    r.range_id, r.range, r.domain, r.message, r.style, r.scope, r.start, r."end", r."end" - r.start AS dur,
    row_number() OVER (PARTITION BY r.range, r.style ORDER BY r.start, r.range_id) AS instance,
    a.proj_start, a.proj_end, coalesce(a.proj_end - a.proj_start, 0) AS proj_ns, a.gpu_ops, a.kernels
FROM ranges AS r
JOIN agg AS a USING (range_id);
