-- Question: where is the GPU idle inside each phase? Per phase name, its $top longest gaps between the union of
-- the GPU ops of one instance (the ops launched inside it on its thread, in start order: a gap is where an op
-- starts after every op before it has ended). phase_ops holds the instances' ops; each instance's own $top
-- longest (a top-n aggregate, no sort of every gap) are the only candidates for its phase's.
WITH gaps AS (
    SELECT range_id, start, max("end") OVER (PARTITION BY range_id ORDER BY start, "end"
                                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM phase_ops
),
top AS (
    SELECT range_id, unnest(max({'gap_ns': start - before, 'neg_start': -before}, $top)) AS g
    FROM gaps
    WHERE start > before
    GROUP BY range_id
)
SELECT p.name, p.instance, -t.g.neg_start AS gap_start_ns, t.g.gap_ns AS gap_ns
FROM top AS t
JOIN phase_inst AS p USING (range_id)
QUALIFY row_number() OVER (PARTITION BY p.name ORDER BY t.g.gap_ns DESC, -t.g.neg_start) <= $top
ORDER BY p.name, gap_ns DESC, gap_start_ns;
