-- Question: what does one steady-state repetition of each workload look like on the timeline? Per workload (the
-- temp table dispatch, level workload), the repetition with the median GPU busy time (the lower middle one of an
-- even count), and its items: `range` (the NVTX ranges inside it on its thread, the repetition itself included,
-- lane = how many of them enclose the range), `op` (its GPU operations: kernel, memcpy, memset), `sync` (the host
-- syncs it holds, on their host call's interval), `idle` (gaps between the union of its GPU operations). At most
-- $max_items items per kind and repetition, the longest first. Reads dispatch, range_instances, range_ops,
-- gpu_ops, range_syncs, host_syncs.
WITH
reps AS (
    SELECT d.range AS workload, d.range_id, i.tid, i.scope, i.start, i."end"
    FROM dispatch AS d JOIN range_instances AS i USING (range_id)
    WHERE d.level = 'workload'
    QUALIFY row_number() OVER (PARTITION BY d.range ORDER BY d.gpu_busy_ns, d.instance)
            = (count(*) OVER (PARTITION BY d.range) + 1) // 2
),
inner_ranges AS (
    SELECT p.workload, i.range_id, i.range AS label, i.start, i."end"
    FROM reps AS p
    JOIN range_instances AS i ON i.tid = p.tid AND i.start >= p.start AND i."end" <= p."end"
    WHERE p.scope = 'thread' OR i.range_id = p.range_id
),
ranges_laned AS (
    SELECT a.workload, 'range' AS kind, a.label, a.start, a."end",
           count(b.range_id) AS lane
    FROM inner_ranges AS a
    LEFT JOIN inner_ranges AS b
      ON b.workload = a.workload AND b.range_id <> a.range_id AND b.start <= a.start AND b."end" >= a."end"
         AND (b.start < a.start OR b."end" > a."end" OR b.range_id < a.range_id)
    GROUP BY a.workload, a.range_id, a.label, a.start, a."end"
),
ops AS (
    SELECT p.workload, o.kind, CASE WHEN o.kind = 'kernel' THEN o.kernel_short ELSE o.kind END AS label,
           o.start, o."end"
    FROM reps AS p JOIN range_ops AS ro ON ro.range_id = p.range_id JOIN gpu_ops AS o ON o.op_id = ro.op_id
),
syncs AS (
    SELECT p.workload, 'sync' AS kind, s.api || ' (' || s.rule || ')' AS label, s.call_start AS start,
           s.call_end AS "end"
    FROM reps AS p JOIN range_syncs AS rs ON rs.range_id = p.range_id JOIN host_syncs AS s USING (sync_id)
),
idle AS (
    SELECT workload, 'idle' AS kind, 'GPU idle' AS label, before AS start, start AS "end"
    FROM (SELECT workload, start,
                 max("end") OVER (PARTITION BY workload ORDER BY start, "end"
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
          FROM ops)
    WHERE start > before
),
items AS (
    SELECT workload, kind, label, start, "end", lane FROM ranges_laned
    UNION ALL SELECT workload, kind, label, start, "end", 0 FROM ops
    UNION ALL SELECT workload, kind, label, start, "end", 0 FROM syncs
    UNION ALL SELECT workload, kind, label, start, "end", 0 FROM idle
)
SELECT workload, kind, label, start AS start_ns, "end" AS end_ns, lane
FROM items
QUALIFY row_number() OVER (PARTITION BY workload, kind = 'range', kind IN ('kernel', 'memcpy', 'memset'), kind
                           ORDER BY "end" - start DESC, start) <= $max_items
ORDER BY workload, start_ns, kind;
