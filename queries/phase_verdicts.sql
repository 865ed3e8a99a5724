-- Question: which rlkernel op calls ran inside each phase, and on which path? Per phase name and op range, the
-- op instances (dispatch, level op) whose range lies inside one of its instances on the same thread, by verdict.
WITH ops AS (
    SELECT DISTINCT p.name, d.range, d.range_id, d.verdict
    FROM phase_inst AS p
    JOIN range_instances AS i ON i.tid = p.tid AND i.start >= p.start AND i."end" <= p."end"
    JOIN dispatch AS d ON d.range_id = i.range_id AND d.level = 'op'
)
SELECT name, range, verdict, count(*) AS calls
FROM ops
GROUP BY name, range, verdict
ORDER BY name, range, calls DESC, verdict;
