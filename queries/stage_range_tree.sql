-- Stage: the push/pop nesting of each thread (verdicts.sql asks which workload repetition holds an op range),
-- from one sweep over its range boundaries in time order (window functions, no interval join: a million
-- ranges cost a sort, not a million-squared comparison). Attribution of launches is stage_range_ops.sql's.
--
-- pp_events: each range's start (+1) and end (-1) in stack order. At one timestamp, ranges that end come
-- first, then zero-length ranges (opened and closed there), then ranges that start; among starts the longer
-- (outer) one first, among ends the later-started (inner) one first. depth_after: open ranges after the event.
CREATE OR REPLACE TEMP TABLE pp_events AS
WITH pp AS (
    SELECT range_id, tid, start, "end" FROM ranges WHERE style = 'PushPop'
),
ev AS (
    SELECT tid, start AS ts, CASE WHEN start = "end" THEN 1 ELSE 3 END AS k, -"end" AS sec, range_id, 1 AS delta
    FROM pp
    UNION ALL
    SELECT tid, "end" AS ts, CASE WHEN start = "end" THEN 2 ELSE 0 END AS k, -start AS sec, range_id, -1 AS delta
    FROM pp
)
SELECT
    tid, ts, delta, range_id,
    row_number() OVER (PARTITION BY tid ORDER BY ts, k, sec, range_id) AS seq,
    sum(delta) OVER (PARTITION BY tid ORDER BY ts, k, sec, range_id
                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS depth_after
FROM ev;

-- range_tree: depth (1 = outermost) and parent. The parent of a range at depth d is the last range of depth
-- d - 1 that started before it on its thread (an ASOF join): with proper nesting it is still open then.
CREATE OR REPLACE TEMP TABLE range_tree AS
WITH starts AS (
    SELECT range_id, tid, seq, depth_after AS depth FROM pp_events WHERE delta = 1
)
SELECT s.range_id, s.tid, s.depth, p.range_id AS parent_id
FROM starts AS s
ASOF LEFT JOIN starts AS p
    ON s.tid = p.tid AND s.depth - 1 = p.depth AND s.seq > p.seq;

-- range_anc: every (range, enclosing range) pair, the range itself included.
CREATE OR REPLACE TEMP TABLE range_anc AS
WITH RECURSIVE anc(range_id, ancestor_id) AS (
    SELECT range_id, range_id FROM range_tree
    UNION ALL
    SELECT a.range_id, t.parent_id
    FROM anc AS a JOIN range_tree AS t ON t.range_id = a.ancestor_id
    WHERE t.parent_id IS NOT NULL
)
SELECT range_id, ancestor_id FROM anc;
