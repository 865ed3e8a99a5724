-- Question: where is the GPU idle inside each phase? Per phase name, its $top longest gaps between the union of
-- the GPU ops of one instance (the ops launched inside it on its thread, in start order: a gap is where an op
-- starts after every op before it has ended).
WITH ops AS (
    SELECT p.name, p.range_id, p.instance, o.start, o."end"
    FROM phase_inst AS p
    JOIN range_ops AS ro USING (range_id)
    JOIN gpu_ops AS o ON o.op_id = ro.op_id
),
reach AS (
    SELECT *, max("end") OVER (PARTITION BY range_id ORDER BY start, "end"
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM ops
)
SELECT name, instance, before AS gap_start_ns, start - before AS gap_ns
FROM reach
WHERE start > before
QUALIFY row_number() OVER (PARTITION BY name ORDER BY start - before DESC, before) <= $top
ORDER BY name, gap_ns DESC, gap_start_ns;
