-- Question (all ranks): per range and rank, the rank's figures beside the others'. Reads rank_list(rank,
-- session_start_ns) and rank_ranges (the union of every rank's cross_rank_partial.sql rows, with its rank).
-- Every range gets a row for every rank: a rank without the range has 0 instances and empty figures.
--
-- start_offset_ns: when the rank's first instance started, on one host clock (the trace's time plus its
--   TARGET_INFO_SESSION_START_TIME.utcEpochNs), after the earliest rank's.
-- slowest_rank: the rank with the longest span (first instance's start to the last one's end; ties: the lower
--   rank); spread: that span over the median span of the ranks that have the range.
-- fused_all_ranks: true only when every rank's verdict is fused (a rank without the range is not); empty for a
--   range no rank judged.
-- busy_imbalance: the largest busy time over the median busy time of the ranks that have the range (the straggler
--   that does more GPU work; a collective evens the spans out, not the work); empty where the median is 0.
WITH
names AS (SELECT DISTINCT range FROM rank_ranges),
placed AS (
    SELECT n.range, k.rank, p.instances, p.range_total_ns, p.span_ns, p.busy_ns, p.comm_ns, p.compute_ns,
           p.overlap_ns, p.verdict, p.required_fused, k.session_start_ns + p.first_start_ns AS host_start_ns
    FROM names AS n
    CROSS JOIN rank_list AS k
    LEFT JOIN rank_ranges AS p ON p.range = n.range AND p.rank = k.rank
),
per_range AS (
    SELECT range,
           CASE WHEN max(span_ns) IS NOT NULL THEN first(rank ORDER BY span_ns DESC NULLS LAST, rank) END
               AS slowest_rank,
           max(span_ns) / nullif(median(span_ns), 0) AS spread,
           max(busy_ns) / nullif(median(busy_ns), 0) AS busy_imbalance,
           min(host_start_ns) AS host_start0,
           CASE WHEN bool_or(verdict IS NOT NULL) THEN bool_and(coalesce(verdict = 'fused', false)) END
               AS fused_all_ranks,
           bool_or(verdict IS NOT NULL) AS judged
    FROM placed
    GROUP BY range
)
SELECT
    p.range,
    p.rank,
    CASE WHEN p.range = '(whole trace)' THEN p.instances ELSE coalesce(p.instances, 0) END AS instances,
    p.range_total_ns,
    p.span_ns,
    p.busy_ns,
    p.host_start_ns - r.host_start0 AS start_offset_ns,
    p.verdict,
    p.required_fused,
    p.comm_ns,
    p.compute_ns,
    p.overlap_ns,
    r.slowest_rank,
    round(r.spread, 4) AS spread,
    r.fused_all_ranks,
    round(r.busy_imbalance, 4) AS busy_imbalance
FROM placed AS p
JOIN per_range AS r USING (range)
ORDER BY p.range <> '(whole trace)', NOT r.judged, p.range, p.rank;
