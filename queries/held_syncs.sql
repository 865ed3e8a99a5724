-- Question: which host syncs do the range instances that must not block hold (--require-no-sync)?
-- Judged instances: fused op ranges (verdict fused, or required fused by their workload); repetitions of a fused
-- single-op workload (expects_fused, and its fused_ops name one op at most: `logp.forward` and `logp.backward`
-- are both `logp`; a training step's several ops may sync between them); every instance of a range named in
-- $ranges (--range, as `domain:name` or the bare message). Reads the temp tables dispatch (verdicts.sql),
-- workload_spec, range_instances, range_syncs and host_syncs. One row per (instance, sync), in call order.
WITH judged AS (
    SELECT d.range_id
    FROM dispatch AS d
    LEFT JOIN workload_spec AS w ON w.range = d.range
    WHERE (d.level = 'op' AND (d.verdict = 'fused' OR d.required_fused))
       OR (d.level = 'workload' AND w.expects_fused
           AND len(list_distinct(list_transform(w.fused_ops, x -> split_part(x, '.', 1)))) <= 1)
    UNION
    SELECT range_id
    FROM range_instances
    WHERE list_contains(CAST($ranges AS VARCHAR[]), range) OR list_contains(CAST($ranges AS VARCHAR[]), message)
)
SELECT coalesce(d.level, 'range') AS level, i.range, i.instance, s.rule, s.api, s.call_start,
       s.call_end - s.call_start AS call_ns
FROM judged AS j
JOIN range_instances AS i ON i.range_id = j.range_id
LEFT JOIN dispatch AS d ON d.range_id = j.range_id
JOIN range_syncs AS rs ON rs.range_id = j.range_id
JOIN host_syncs AS s ON s.sync_id = rs.sync_id
ORDER BY s.call_start, i.range, i.instance;
