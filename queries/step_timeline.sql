-- Question: what does a typical step look like on the timeline? The step instance (phase_inst, is_step) with the
-- median wall span (the lower middle one of an even count), as timeline.sql's items: `range` (the step and the
-- phase instances inside it, lane = how many of them enclose one), its GPU operations (kernel, memcpy, memset),
-- `sync` (its host syncs, on their host call's interval), `idle` (gaps between the union of its GPU operations).
-- At most $max_items items per kind, the longest first.
WITH
rep AS (
    SELECT range_id, step_index, start, "end"
    FROM phase_inst WHERE is_step
    QUALIFY row_number() OVER (ORDER BY dur, start) = (count(*) OVER () + 1) // 2
),
workload AS (SELECT 'step ' || step_index AS workload, * FROM rep),
inner_ranges AS (
    SELECT w.workload, p.range_id, p.range AS label, p.start, p."end"
    FROM workload AS w JOIN phase_inst AS p ON p.step_id = w.range_id
),
ranges_laned AS (
    SELECT a.workload, 'range' AS kind, a.label, a.start, a."end", count(b.range_id) AS lane
    FROM inner_ranges AS a
    LEFT JOIN inner_ranges AS b
      ON b.range_id <> a.range_id AND b.start <= a.start AND b."end" >= a."end"
         AND (b.start < a.start OR b."end" > a."end" OR b.range_id < a.range_id)
    GROUP BY a.workload, a.range_id, a.label, a.start, a."end"
),
ops AS (
    SELECT w.workload, o.kind, CASE WHEN o.kind = 'kernel' THEN o.kernel_short ELSE o.kind END AS label,
           o.start, o."end"
    FROM workload AS w JOIN range_ops AS ro ON ro.range_id = w.range_id JOIN gpu_ops AS o ON o.op_id = ro.op_id
),
syncs AS (
    SELECT w.workload, 'sync' AS kind, s.api || ' (' || s.rule || ')' AS label, s.call_start AS start,
           s.call_end AS "end"
    FROM workload AS w JOIN range_syncs AS rs ON rs.range_id = w.range_id JOIN host_syncs AS s USING (sync_id)
),
idle AS (
    SELECT workload, 'idle' AS kind, 'GPU idle' AS label, before AS start, start AS "end"
    FROM (SELECT workload, start,
                 max("end") OVER (ORDER BY start, "end" ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
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
QUALIFY row_number() OVER (PARTITION BY kind = 'range', kind IN ('kernel', 'memcpy', 'memset'), kind
                           ORDER BY "end" - start DESC, start) <= $max_items
ORDER BY start_ns, kind;
