-- Question: in each workload repetition, where was the GPU idle longest, and what was the host thread doing
-- meanwhile? Per repetition (the temp table dispatch, level workload), the gaps between the union of its GPU
-- operations (inside its projection: first op start to last op end), the $top longest, each with the CUDA runtime
-- calls of the repetition's thread (the process's, for a start/end range ended on another thread) that overlap
-- it: how many, how many of them are host syncs (stage_host_syncs.sql), the longest three by overlap, and the
-- host time the gap leaves uncovered by any call (Python, the OS, a sleep). A gap with no call at all: the host
-- was not in CUDA. Reads dispatch, range_ops, gpu_ops, range_instances, host_syncs, src_CUPTI_ACTIVITY_KIND_RUNTIME.
WITH
reps AS (
    SELECT d.range_id, d.range, d.instance, i.tid, i.scope
    FROM dispatch AS d JOIN range_instances AS i USING (range_id)
    WHERE d.level = 'workload'
),
ops AS (
    SELECT ro.range_id, o.start, o."end"
    FROM range_ops AS ro JOIN gpu_ops AS o ON o.op_id = ro.op_id
    WHERE ro.range_id IN (SELECT range_id FROM reps)
),
reach AS (
    SELECT range_id, start,
           max("end") OVER (PARTITION BY range_id ORDER BY start, "end"
                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM ops
),
gaps AS (
    SELECT range_id, before AS gap_start, start AS gap_end, start - before AS gap_ns,
           row_number() OVER (PARTITION BY range_id ORDER BY start - before DESC, before) AS rank
    FROM reach
    WHERE start > before
    QUALIFY rank <= $top
),
calls AS (
    SELECT g.range_id, g.rank, n.value AS api, r.start, r."end",
           least(r."end", g.gap_end) - greatest(r.start, g.gap_start) AS overlap_ns,
           EXISTS (SELECT 1 FROM host_syncs AS s WHERE s.tid = r.globalTid AND s.call_start = r.start) AS is_sync
    FROM gaps AS g
    JOIN reps AS p USING (range_id)
    JOIN src_CUPTI_ACTIVITY_KIND_RUNTIME AS r
      ON (CASE WHEN p.scope = 'thread' THEN r.globalTid = p.tid ELSE (r.globalTid >> 24) = (p.tid >> 24) END)
     AND r.start < g.gap_end AND r."end" > g.gap_start
    LEFT JOIN src_StringIds AS n ON n.id = r.nameId
),
per_gap AS (
    SELECT range_id, rank, count(*) AS host_calls, count(*) FILTER (WHERE is_sync) AS host_syncs,
           sum(overlap_ns) AS in_calls_ns,
           string_agg(api || ' ' || overlap_ns || ' ns', '; ' ORDER BY overlap_ns DESC, start)
               FILTER (WHERE call_rank <= 3) AS longest_calls
    FROM (SELECT *, row_number() OVER (PARTITION BY range_id, rank ORDER BY overlap_ns DESC, start) AS call_rank
          FROM calls)
    GROUP BY range_id, rank
)
SELECT
    p.range AS workload, p.instance, g.rank AS gap_rank, g.gap_start AS gap_start_ns, g.gap_ns,
    coalesce(c.host_calls, 0) AS host_calls, coalesce(c.host_syncs, 0) AS host_syncs,
    -- Calls of one thread do not overlap each other, so their overlaps add up to the time spent in them.
    g.gap_ns - coalesce(c.in_calls_ns, 0) AS outside_calls_ns,
    coalesce(c.longest_calls, '') AS longest_calls
FROM gaps AS g
JOIN reps AS p USING (range_id)
LEFT JOIN per_gap AS c ON c.range_id = g.range_id AND c.rank = g.rank
ORDER BY p.range, p.instance, g.rank;
