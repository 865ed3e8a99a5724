-- Question: which rlkernel op calls ran inside each phase, and on which path? Per phase name and op range, the
-- op instances (dispatch, level op) whose range lies inside one of its instances on the same thread, by verdict.
-- (The op ranges are taken first: far fewer than the trace's ranges, they bound the interval join.)
WITH op AS (
    SELECT d.range, d.range_id, d.verdict, i.tid, i.start, i."end"
    FROM dispatch AS d JOIN range_instances AS i USING (range_id)
    WHERE d.level = 'op'
),
ops AS (
    SELECT DISTINCT p.name, op.range, op.range_id, op.verdict
    FROM op JOIN phase_inst AS p ON op.tid = p.tid AND op.start >= p.start AND op."end" <= p."end"
)
SELECT name, range, verdict, count(*) AS calls
FROM ops
GROUP BY name, range, verdict
ORDER BY name, range, calls DESC, verdict;
