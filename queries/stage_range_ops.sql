-- Stage: which GPU operations belong to which range instance (NVIDIA's rule: the ranges open on the CPU
-- thread that launched the operation, at the time of its launch call, every enclosing level counting).
-- A launch call [launch_start, launch_end] is inside a range when start <= launch_start and launch_end <= end.
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
-- Start/end ranges ended on their own thread: that thread's launches inside them. These overlap freely (no
-- stack), so this is an interval join; it is keyed on the thread and such ranges are few in practice.
SELECT r.range_id, o.op_id
FROM ranges AS r
JOIN gpu_ops AS o
    ON o.launch_tid = r.tid AND o.launch_start >= r.start AND o.launch_end <= r."end"
WHERE r.style = 'StartEnd' AND r.scope = 'thread'
UNION ALL
-- Start/end ranges ended on another thread: every launch of the process inside the range's time window.
SELECT r.range_id, o.op_id
FROM ranges AS r
JOIN gpu_ops AS o
    ON (o.launch_tid >> 24) = r.proc AND o.launch_start >= r.start AND o.launch_end <= r."end"
WHERE r.scope = 'process';

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
