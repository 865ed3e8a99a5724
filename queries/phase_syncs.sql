-- Question: which host calls block in each phase? Per phase name, its $top host-sync calls (NVIDIA's four rules,
-- stage_host_syncs.sql) by count, a sync held by two nested instances of one phase counted once.
WITH s AS (
    SELECT DISTINCT p.name, h.sync_id, h.api, h.rule, h.call_end - h.call_start AS call_ns
    FROM phase_inst AS p
    JOIN range_syncs AS rs USING (range_id)
    JOIN host_syncs AS h USING (sync_id)
)
SELECT name, api, rule, count(*) AS calls, CAST(sum(call_ns) AS BIGINT) AS call_ns
FROM s
GROUP BY name, api, rule
QUALIFY row_number() OVER (PARTITION BY name ORDER BY count(*) DESC, sum(call_ns) DESC, api) <= $top
ORDER BY name, calls DESC, call_ns DESC, api;
