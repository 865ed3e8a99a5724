-- Stage: range_instances, one row per range instance with what its attributed GPU operations did.
--   proj_ns      the GPU projection (nvtx_gpu_proj_sum): first op start to last op end, copies and sets
--                included, even when they run after the range closed (proj_start, proj_end);
--   gpu_ops      launch calls (one graph launch is one op, as nvtx_gpu_proj_sum counts them);
--   kernel_ns    the sum of the kernels' durations (overlapping kernels each count: it can exceed the span);
--   gpu_busy_ns  the union of the ops' intervals on the GPU timeline (kernels, copies, sets): time the GPU
--                worked for the range, each nanosecond once; gpu_idle_ns = proj_ns - gpu_busy_ns;
--   host_syncs   the blocking calls (host_syncs) the range's thread made inside it;
--   dtoh_copies  device-to-host copies (copyKind 2).
CREATE OR REPLACE TEMP TABLE range_instances AS
WITH pairs AS (
    SELECT ro.range_id, o.start, o."end", o.dur, o.kind, o.correlationId, o.copy_kind
    FROM range_ops AS ro
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
),
agg AS (
    SELECT
        range_id,
        min(start) AS proj_start,
        max("end") AS proj_end,
        count(DISTINCT correlationId) AS gpu_ops,
        count(*) FILTER (WHERE kind = 'kernel') AS kernels,
        sum(dur) FILTER (WHERE kind = 'kernel') AS kernel_ns,
        count(*) FILTER (WHERE kind = 'memcpy' AND copy_kind = 2) AS dtoh_copies,
        count(*) AS n_ops
    FROM pairs
    GROUP BY range_id
),
-- The union of intervals in one pass: in start order, each op adds what it reaches past every op before it.
-- Ranges with one op (the usual range around one launch) skip the window: their busy time is the op's.
reach AS (
    SELECT p.range_id, p.start, p."end",
           max(p."end") OVER (PARTITION BY p.range_id ORDER BY p.start, p."end"
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM pairs AS p
    WHERE p.range_id IN (SELECT range_id FROM agg WHERE n_ops > 1)
),
busy AS (
    SELECT range_id, sum(greatest(0, "end" - greatest(start, coalesce(before, start)))) AS busy_ns
    FROM reach
    GROUP BY range_id
),
syncs AS (
    SELECT range_id, count(*) AS host_syncs FROM range_syncs GROUP BY range_id
)
SELECT
    r.range_id, r.range, r.domain, r.message, r.style, r.scope, r.tid, r.start, r."end", r."end" - r.start AS dur,
    row_number() OVER (PARTITION BY r.range, r.style ORDER BY r.start, r.range_id) AS instance,
    a.proj_start, a.proj_end, coalesce(a.proj_end - a.proj_start, 0) AS proj_ns,
    coalesce(a.gpu_ops, 0) AS gpu_ops, coalesce(a.kernels, 0) AS kernels,
    CAST(coalesce(a.kernel_ns, 0) AS BIGINT) AS kernel_ns,
    CAST(coalesce(b.busy_ns, a.proj_end - a.proj_start, 0) AS BIGINT) AS gpu_busy_ns,
    CAST(coalesce(a.proj_end - a.proj_start, 0) - coalesce(b.busy_ns, a.proj_end - a.proj_start, 0) AS BIGINT)
        AS gpu_idle_ns,
    coalesce(s.host_syncs, 0) AS host_syncs,
    coalesce(a.dtoh_copies, 0) AS dtoh_copies
FROM ranges AS r
LEFT JOIN agg AS a USING (range_id)
LEFT JOIN busy AS b USING (range_id)
LEFT JOIN syncs AS s USING (range_id);
