-- Question (one rank, run on its staged tables after the single-trace analysis): per range name, how many
-- instances, how long on the host, how busy the GPU was for it, and how its kernels split into communication
-- and compute. One extra row, range '(whole trace)', covers every GPU operation of the rank.
-- Parameters: $comm_patterns (kernel-name globs of communication kernels, matched against the short and the
-- demangled name; default nccl*).
--
-- busy_ns: the union of the GPU operations attributed to the range's instances (kernels, copies, sets; as the
--   projection attributes them), so overlapping streams count once. kernel_ns, comm_ns, compute_ns: the union of
--   its kernels, of its communication kernels, of its other kernels; overlap_ns = comm_ns + compute_ns - kernel_ns
--   is the time both ran at once.
-- first_start_ns/last_end_ns: the first instance's start and the last one's end on the trace's clock (the whole-
--   trace row: the first GPU operation's start and the last one's end); span_ns between them.
-- verdict: over the range's dispatch rows (verdict_over, the rule of workload_summary.sql); NULL for a range that is
--   neither a workload nor an op range.
WITH
comm_names AS (
    SELECT g.kernel, bool_or(g.kernel_short GLOB p.pat OR g.kernel GLOB p.pat) AS comm
    FROM (SELECT DISTINCT kernel, kernel_short FROM gpu_ops WHERE kind = 'kernel') AS g
    CROSS JOIN unnest(CAST($comm_patterns AS VARCHAR[])) AS p(pat)
    GROUP BY g.kernel
),
ops AS (
    SELECT i.range, o.kind, o.start, o."end", coalesce(c.comm, false) AS comm
    FROM range_ops AS ro
    JOIN range_instances AS i ON i.range_id = ro.range_id
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
    LEFT JOIN comm_names AS c ON c.kernel = o.kernel
    UNION ALL
    SELECT '(whole trace)', o.kind, o.start, o."end", coalesce(c.comm, false)
    FROM gpu_ops AS o
    LEFT JOIN comm_names AS c ON c.kernel = o.kernel
),
has_comm AS (SELECT DISTINCT range FROM ops WHERE comm),
classed AS (
    SELECT range, 'busy' AS cls, start, "end" FROM ops
    UNION ALL
    SELECT range, CASE WHEN comm THEN 'comm' ELSE 'compute' END, start, "end" FROM ops WHERE kind = 'kernel'
    UNION ALL
    -- every kernel together, needed for the overlap only where the range has communication kernels
    SELECT range, 'kernel', start, "end" FROM ops WHERE kind = 'kernel' AND range IN (SELECT range FROM has_comm)
),
-- The length of a union of intervals in one pass: in start order, each interval adds what lies past the latest
-- end of the ones before it.
marked AS (
    SELECT range, cls, start, "end",
           max("end") OVER (PARTITION BY range, cls ORDER BY start, "end"
                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
    FROM classed
),
unions AS (
    SELECT range,
           sum(added) FILTER (WHERE cls = 'busy') AS busy_ns,
           sum(added) FILTER (WHERE cls = 'kernel') AS kernel_ns,
           sum(added) FILTER (WHERE cls = 'comm') AS comm_ns,
           sum(added) FILTER (WHERE cls = 'compute') AS compute_ns
    FROM (SELECT range, cls, greatest(0, "end" - greatest(start, coalesce(prev_end, start))) AS added FROM marked)
    GROUP BY range
),
host AS (
    SELECT range, count(*) AS instances, sum(dur) AS range_total_ns, min(start) AS first_start_ns,
           max("end") AS last_end_ns
    FROM range_instances
    GROUP BY range
    UNION ALL
    SELECT '(whole trace)', NULL, NULL, min(start), max("end") FROM gpu_ops
),
verdicts AS (
    SELECT range,
           verdict_over(verdict) AS verdict,  -- stage_macros.sql, the rule workload_summary.sql uses
           bool_or(required_fused) AS required_fused
    FROM dispatch
    GROUP BY range
)
SELECT
    h.range,
    CAST(h.instances AS BIGINT) AS instances,
    CAST(h.range_total_ns AS BIGINT) AS range_total_ns,
    CAST(h.first_start_ns AS BIGINT) AS first_start_ns,
    CAST(h.last_end_ns AS BIGINT) AS last_end_ns,
    CAST(h.last_end_ns - h.first_start_ns AS BIGINT) AS span_ns,
    CAST(coalesce(u.busy_ns, 0) AS BIGINT) AS busy_ns,
    CAST(coalesce(u.comm_ns, 0) AS BIGINT) AS comm_ns,
    CAST(coalesce(u.compute_ns, 0) AS BIGINT) AS compute_ns,
    CAST(CASE WHEN u.kernel_ns IS NULL THEN 0 ELSE u.comm_ns + coalesce(u.compute_ns, 0) - u.kernel_ns END
         AS BIGINT) AS overlap_ns,
    v.verdict,
    coalesce(v.required_fused, false) AS required_fused
FROM host AS h
LEFT JOIN unions AS u ON u.range = h.range
LEFT JOIN verdicts AS v ON v.range = h.range
ORDER BY h.range;
